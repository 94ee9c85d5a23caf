/* The check macro of the C test programs: counts checks and failures in
 * the including file's `checks` and `failures` and prints one line each. */
#ifndef SNOWRDMA_EXAMPLES_CHECK_H
#define SNOWRDMA_EXAMPLES_CHECK_H

#include <stdio.h>

#define CHECK(cond, what)                                                                                  \
    do {                                                                                                   \
        checks++;                                                                                          \
        if (cond) {                                                                                        \
            printf("ok   %s\n", what);                                                                     \
        } else {                                                                                           \
            printf("FAIL %s\n", what);                                                                     \
            failures++;                                                                                    \
        }                                                                                                  \
    } while (0)

#endif
