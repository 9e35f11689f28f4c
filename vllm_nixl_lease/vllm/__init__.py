"""vLLM adapters: thin subclasses of vLLM's own NIXL connector classes that
route all KV-lease bookkeeping through the lease core.

Importing this subpackage imports vLLM; the top-level ``vllm_nixl_lease``
package never does (it reaches here lazily).
"""
