"""vLLM adapters: thin subclasses of vLLM's own NIXL connector classes that
route all KV-lease bookkeeping through the lease core.

Importing this subpackage imports vLLM; the top-level ``vllm_nixl_lease``
package never does (it reaches here lazily).
"""

import logging as _logging
import os as _os


class _ToVllmLogger(_logging.Handler):
    """Hands our records to the "vllm" logger's handlers, whatever they are
    when the record is emitted (vLLM configures logging after imports)."""

    def emit(self, record: _logging.LogRecord) -> None:
        _logging.getLogger("vllm").handle(record)


def _adopt_vllm_logging() -> None:
    # vLLM configures only the "vllm" logger: ours would otherwise reach just
    # Python's last-resort handler (WARNING and up, unformatted). A logging
    # config that names "vllm_nixl_lease" (VLLM_LOGGING_CONFIG_PATH) replaces this.
    ours = _logging.getLogger("vllm_nixl_lease")
    if ours.handlers:
        return
    ours.addHandler(_ToVllmLogger())
    ours.propagate = False  # "vllm" propagates (or not) on its own
    if ours.level == _logging.NOTSET:
        ours.setLevel(_os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())


_adopt_vllm_logging()
