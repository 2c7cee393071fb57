#include <infiniband/verbs.h>
/* Defined by build.rs with the rdma_cm feature. */
#ifdef RDMA_COMM_CORE_CM
#include <rdma/rdma_cma.h>
#endif
