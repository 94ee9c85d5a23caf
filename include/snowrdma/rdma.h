/* The SnowRDMA header under its project directory: #include <snowrdma/rdma.h>. */
#include "../rdma.h"
