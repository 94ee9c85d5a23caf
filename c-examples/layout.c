/* Checks, at compile time and at run time, that rdma.h lays out every
 * legacy struct to the byte, and that the globals have their legacy defaults.
 * Exits 0 when all hold. */
#include <rdma.h>

#include <stddef.h>
#include <stdio.h>

#define AT(T, f, off) _Static_assert(offsetof(T, f) == (off), #T "." #f " at " #off)
#define SIZE(T, n) _Static_assert(sizeof(T) == (n), "sizeof " #T " is " #n)

SIZE(RdmaCmd, 32);
AT(RdmaCmd, magic, 0); AT(RdmaCmd, version, 1); AT(RdmaCmd, cmd_opcode, 2); AT(RdmaCmd, rsvd, 3);
AT(RdmaCmd, addr, 16); AT(RdmaCmd, length, 24); AT(RdmaCmd, key, 28);

SIZE(RdmaWrCtx, 24);
AT(RdmaWrCtx, type, 0); AT(RdmaWrCtx, rdma_conn, 8); AT(RdmaWrCtx, private_data, 16);

SIZE(RdmaOptions, 104);
AT(RdmaOptions, rdma_listen_backlog, 0); AT(RdmaOptions, rdma_timeoutms, 4);
AT(RdmaOptions, rdma_poll_event_timeoutms, 8); AT(RdmaOptions, rdma_max_inline_data, 12);
AT(RdmaOptions, rdma_retry_count, 16); AT(RdmaOptions, rdma_rnr_retry_count, 20);
AT(RdmaOptions, rdma_max_concurrent_work_requests, 24); AT(RdmaOptions, rdma_recv_depth, 28);
AT(RdmaOptions, rdma_qp2cq_mode, 32); AT(RdmaOptions, rdma_comm_mode, 36);
AT(RdmaOptions, rdma_enable_phys_addr_access, 40); AT(RdmaOptions, rdma_max_outstanding_rd_atomic, 44);
AT(RdmaOptions, rdma_io_affinity_cpuid, 48); AT(RdmaOptions, recv_callback, 56);
AT(RdmaOptions, write_callback, 64); AT(RdmaOptions, read_callback, 72);
AT(RdmaOptions, connected_callback, 80); AT(RdmaOptions, disconnect_callback, 88);
AT(RdmaOptions, accept_callback, 96);
SIZE(RdmaServerOptions, 104);
SIZE(RdmaConnOptions, 104);

SIZE(RdmaConn, 456);
AT(RdmaConn, cm_id, 0); AT(RdmaConn, last_errno, 8); AT(RdmaConn, state, 12); AT(RdmaConn, type, 16);
AT(RdmaConn, ip, 24); AT(RdmaConn, port, 32); AT(RdmaConn, pd, 40); AT(RdmaConn, cm_channel, 48);
AT(RdmaConn, comp_channel, 56); AT(RdmaConn, cq, 64); AT(RdmaConn, max_inline_data, 72);
AT(RdmaConn, tx_addr, 80); AT(RdmaConn, tx_length, 88); AT(RdmaConn, tx_offset, 92);
AT(RdmaConn, tx_key, 96); AT(RdmaConn, send_buf, 104); AT(RdmaConn, send_length, 112);
AT(RdmaConn, send_offset, 116); AT(RdmaConn, send_ops, 120); AT(RdmaConn, send_mr, 128);
AT(RdmaConn, rx_offset, 136); AT(RdmaConn, recv_buf, 144); AT(RdmaConn, recv_length, 152);
AT(RdmaConn, recv_offset, 156); AT(RdmaConn, recv_mr, 160); AT(RdmaConn, tx_pa_rkey, 168);
AT(RdmaConn, tx_pa_addr, 176); AT(RdmaConn, tx_pa_length, 184); AT(RdmaConn, tx_pa_offset, 188);
AT(RdmaConn, cmd_buf, 192); AT(RdmaConn, cmd_mr, 200); AT(RdmaConn, rx_ctx, 208);
AT(RdmaConn, tx_ctx, 216); AT(RdmaConn, status_cond, 224); AT(RdmaConn, status_mutex, 272);
AT(RdmaConn, options, 312); AT(RdmaConn, recv_callback, 416); AT(RdmaConn, write_callback, 424);
AT(RdmaConn, read_callback, 432); AT(RdmaConn, connected_callback, 440);
AT(RdmaConn, disconnect_callback, 448);

SIZE(RdmaListener, 128);
AT(RdmaListener, cm_id, 0); AT(RdmaListener, cm_channel, 8); AT(RdmaListener, options, 16);
AT(RdmaListener, accept_callback, 120);

_Static_assert(RDMA_OK == 0 && RDMA_ERR == -1, "result codes");
_Static_assert(RDMA_MAX_SGE == 1024 && RDMA_DEFAULT_RX_LEN == 1024 * 1024, "limits");
_Static_assert(RDMA_CMD_MAGIC == 'R', "magic");
_Static_assert(REG_LOCAL_ADDR == 0 && REG_PHYS_ADDR == 1 && CONN_GOODBYE == 2, "commands");
_Static_assert(ONE_TO_ONE == 0 && MANY_TO_ONE == 1, "qp/cq mapping");
_Static_assert(RDMA_BLOCKING == 0 && RDMA_NON_BLOCKING == 1, "comm modes");
_Static_assert(RDMA_CONN_STATE_NONE == 0 && RDMA_CONN_STATE_MR_READY == 4 && RDMA_CONN_STATE_ERROR == 6, "states");
_Static_assert(ACCEPTED_CONN == 0 && CONNECTED_CONN == 1, "connection types");
_Static_assert(RECV_CONTEXT == 0 && WRITE_CONTEXT == 1 && SEND_CONTEXT == 2, "contexts");

int main(void)
{
    int bad = 0;
#define DEFAULT(g, v) do { if ((g) != (v)) { fprintf(stderr, #g " is %d, expected %d\n", (int)(g), (int)(v)); bad = 1; } } while (0)
    DEFAULT(rdmaListenBacklog, 128);
    DEFAULT(rdmaTimeoutms, 1000);
    DEFAULT(rdmaPollEventTimeoutms, 10);
    DEFAULT(rdmaMaxInlineData, 0);
    DEFAULT(rdmaRetryCount, 7);
    DEFAULT(rdmaRnrRetryCount, 7);
    DEFAULT(rdmaMaxConcurrentWorkRequests, 128 + 2048 * 2);
    DEFAULT(rdmaRecvDepth, 1024);
    DEFAULT(rdmaMaxOutstandingRdAtomic, 0);
    DEFAULT(rdmaQp2CqMode, ONE_TO_ONE);
    DEFAULT(rdmaCommMode, RDMA_NON_BLOCKING);
    DEFAULT(rdmaEnablePhysAddrAccess, false);
    DEFAULT(rdmaIoAffinityCpuId, -1);
    rdmaTimeoutms = 2500; /* programs write the globals too */
    DEFAULT(rdmaTimeoutms, 2500);
    printf(bad ? "layout: FAILED\n" : "layout: every size, offset, constant and default matches\n");
    return bad;
}
