/* The machine probes' library (probe.py) as one translation unit: the pool, then the probes that
   split over it (they call pool_rows, static here: see linkage.h). Built only when a benchmark asks
   for the step limit, apart from the kernels' library, which serves no probe. */
#define KERNEL_UNITY_BUILD

#include "kernel_pool.c"
#include "probe.c"
