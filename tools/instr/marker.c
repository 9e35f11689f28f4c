/* Callgrind client requests for tools/instr: switch instrumentation and
 * collection from Python (ctypes), and dump one measurement per label.
 * Outside valgrind each request is a no-op sequence of a few instructions. */
#include <valgrind/callgrind.h>

int instr_running_on_valgrind(void) { return (int)RUNNING_ON_VALGRIND; }
void instr_start_instrumentation(void) { CALLGRIND_START_INSTRUMENTATION; }
void instr_stop_instrumentation(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void instr_zero(void) { CALLGRIND_ZERO_STATS; }
void instr_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void instr_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
