/* Which instruction-set path a built library holds: loaders/native/kernel_build.py checks it against the one it asked
 * for before binding any kernel, so a mislabelled cache entry is rebuilt instead of run on the wrong CPU. */
#include "common.h"

const char *lm_isa(void) { return LM_ISA; }
