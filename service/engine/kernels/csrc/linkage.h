/* How the helpers the C files share are linked (KERNEL_PRIVATE on their declarations and definitions).

Each library is compiled as one translation unit (unity_kernels.c, unity_probe.c), which defines
KERNEL_UNITY_BUILD before it includes the sources: there a shared helper is `static`, as if the files
were one, so the compiler sees every caller, inlines across files and exports only the entry points
(as SQLite's amalgamation does). A file compiled alone (the warning checks compile each one) sees
the helpers of other files `extern`, declared in the headers; no library is built that way. */
#ifndef MOESPEC_LINKAGE_H
#define MOESPEC_LINKAGE_H

#if defined(KERNEL_UNITY_BUILD)
#define KERNEL_PRIVATE static
#else
#define KERNEL_PRIVATE extern
#endif

#endif
