//! The one list of benchmark cases, in the order the script measures and
//! the report shows them: adding a case is one entry.

use super::broker_cases::{broker_all_to_all, broker_lat, broker_rate};
use super::c_api_cases::{echo_lat, echo_remote_lat, stream, stream_remote, sync_lat};
use super::kv_cases::{kv_bw, kv_bw_remote, kv_lat, kv_lat_remote, kv_mix, KvOp, IDLE_CLIENTS};
use super::safe_cases::{safe_send_lat, safe_write_bw, safe_write_lat};
use super::verbs_cases::{verbs_imm_lat, verbs_op_lat, verbs_write_lat, VerbsOp};

use super::cases::{against, bw, here, kv_app, kv_procs, lat, perftest, Case, Measure};

/// Our sink for the two-process stream rows.
const SINK: &str = "BENCH sink --port PORT";

/// The far ends of the two-process verbs, safe API and broker rows.
const TARGET: &str = "BENCH peer target --port PORT --size 64";
const TARGET_64K: &str = "BENCH peer target --port PORT --size 65536";
const WRITE_PONG: &str = "BENCH peer write-pong --port PORT --size 64";
const IMM_PONG: &str = "BENCH peer imm-pong --port PORT --size 64";
const SEND_PONG: &str = "BENCH peer send-pong --port PORT --size 64";
const BROKER_SINK: &str = "BENCH peer broker-sink --port PORT";
const BROKER_ECHO: &str = "BENCH peer broker-echo --port PORT";

/// One signaled WRITE through our verbs layer, post to completion, to a
/// target in another process: the reference of the signaled-WRITE rows
/// (perftest has no signaled-WRITE latency).
const VERBS_SIGNALED_WRITE: Measure = against(
    TARGET,
    |n, s, p| verbs_op_lat(VerbsOp::Write, n, s, p),
    64,
    1000,
);

/// Our kv_server for the two-process kv rows.
const KV_SERVER: &str = "target/release/kv_server -a IP -p PORT -m 256";

pub(crate) const CASES: &[Case] = &[
    // The verbs layer, each operation as its perftest program does it.
    lat(
        "write_lat",
        "verbs RDMA WRITE 64 B, half RTT, 2 procs",
        "ib_write_lat",
        "<= 1.05",
        perftest("ib_write_lat", 5, "-s 64 -n 1000"),
        against(WRITE_PONG, verbs_write_lat, 64, 1000),
    ),
    lat(
        "read_lat",
        "verbs RDMA READ 64 B, 2 procs",
        "ib_read_lat",
        "<= 1.05",
        perftest("ib_read_lat", 5, "-s 64 -n 1000"),
        against(
            TARGET,
            |n, s, p| verbs_op_lat(VerbsOp::Read, n, s, p),
            64,
            1000,
        ),
    ),
    lat(
        "cas_lat",
        "verbs atomic CAS, 2 procs",
        "ib_atomic_lat",
        "<= 1.05",
        perftest("ib_atomic_lat", 5, "-n 1000"),
        against(
            TARGET,
            |n, s, p| verbs_op_lat(VerbsOp::CompareSwap, n, s, p),
            8,
            1000,
        ),
    ),
    // The C API's synchronous one-sided operations.
    lat(
        "sync_read",
        "rdmaSyncReadSignaled 64 B, 2 procs",
        "ib_read_lat",
        "<= 1.10",
        perftest("ib_read_lat", 5, "-s 64 -n 1000"),
        against(SINK, |n, s, p| sync_lat(true, n, s, p), 64, 1000),
    ),
    lat(
        "sync_write",
        "rdmaSyncWriteSignaled 64 B, 2 procs",
        "verbs signaled WRITE",
        "<= 1.10",
        VERBS_SIGNALED_WRITE,
        against(SINK, |n, s, p| sync_lat(false, n, s, p), 64, 1000),
    ),
    // WRITE WITH IMM ping-pong, each side spinning on its receive CQ: the
    // runtime's wire operation without the runtime.
    lat(
        "imm_lat",
        "verbs WRITE WITH IMM 64 B, half RTT, 2 procs",
        "ib_send_lat",
        "reported",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        against(IMM_PONG, verbs_imm_lat, 64, 1000),
    ),
    // The C API's messages.
    lat(
        "echo_lat_2p",
        "rdmaConnSend echo 64 B, half RTT, 2 procs",
        "ib_send_lat",
        "<= 1.30",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        against(
            "target/c-examples/echo_server IP PORT",
            echo_remote_lat,
            64,
            1000,
        ),
    ),
    // The in-process rows count both ends' costs in one process.
    lat(
        "echo_lat",
        "rdmaConnSend echo 64 B, half RTT, 1 proc",
        "ib_send_lat",
        "reported",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        here(echo_lat, 64, 1000),
    ),
    // The same echo client, in its own process, against our echo_server
    // (as the legacy sample echoes) and against a legacy-protocol peer.
    lat(
        "echo_legacy_lat",
        "rdmaConnSend echo 64 B vs legacy-protocol peer, 2 procs",
        "echo_server, 2 procs",
        "<= 1.0",
        Measure::AgainstServer {
            server: "target/c-examples/echo_server IP PORT legacy",
            run: echo_remote_lat,
            size: 64,
            iters: 1000,
        },
        Measure::AgainstServer {
            server: "BENCH legacy-peer --port PORT",
            run: echo_remote_lat,
            size: 64,
            iters: 1000,
        },
    ),
    bw(
        "stream_bw_2p",
        "rdmaConnSend stream 64 KiB, 2 procs",
        "ib_write_bw",
        "MiB/s",
        ">= 0.95",
        perftest("ib_write_bw", 4, "-s 65536 -n 1000"),
        against(SINK, |n, s, p| stream_remote(n, s, p).0, 65536, 1000),
    ),
    bw(
        "msg_rate_2p",
        "rdmaConnSend 64 B message rate, 2 procs",
        "ib_write_bw -s 64",
        "Mpps",
        ">= 0.90",
        perftest("ib_write_bw", 5, "-s 64 -n 20000"),
        against(SINK, |n, s, p| stream_remote(n, s, p).1, 64, 20000),
    ),
    bw(
        "stream_bw",
        "rdmaConnSend stream 64 KiB, 1 proc",
        "ib_write_bw",
        "MiB/s",
        "reported",
        perftest("ib_write_bw", 4, "-s 65536 -n 1000"),
        here(|n, s, p| stream(n, s, p).0, 65536, 1000),
    ),
    bw(
        "msg_rate",
        "rdmaConnSend 64 B message rate, 1 proc",
        "ib_write_bw -s 64",
        "Mpps",
        "reported",
        perftest("ib_write_bw", 5, "-s 64 -n 20000"),
        here(|n, s, p| stream(n, s, p).1, 64, 20000),
    ),
    // The safe API beside the raw verbs layer (its cost: at most 5%) and
    // perftest.
    lat(
        "safe_write_lat",
        "safe API WRITE 64 B, post to completion, 2 procs",
        "verbs signaled WRITE",
        "<= 1.05",
        VERBS_SIGNALED_WRITE,
        against(TARGET, safe_write_lat, 64, 1000),
    ),
    lat(
        "safe_send_lat",
        "safe API SEND 64 B ping-pong, half RTT, 2 procs",
        "ib_send_lat",
        "<= 1.05",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        against(SEND_PONG, safe_send_lat, 64, 1000),
    ),
    bw(
        "safe_write_bw",
        "safe API WRITE 64 KiB, 8 per doorbell, 2 procs",
        "ib_write_bw",
        "MiB/s",
        ">= 0.95",
        perftest("ib_write_bw", 4, "-s 65536 -n 1000"),
        against(TARGET_64K, safe_write_bw, 65536, 1000),
    ),
    // The RC message broker.
    bw(
        "broker_rate_b1",
        "broker 64 B messages, batch 1, 2 procs",
        "ib_write_bw -s 64",
        "Mpps",
        "reported",
        perftest("ib_write_bw", 5, "-s 64 -n 20000"),
        against(BROKER_SINK, |n, s, p| broker_rate(1, n, s, p), 64, 20000),
    ),
    bw(
        "broker_rate_b8",
        "broker 64 B messages, batch 8, 2 procs",
        "ib_write_bw -s 64",
        "Mpps",
        "reported",
        perftest("ib_write_bw", 5, "-s 64 -n 20000"),
        against(BROKER_SINK, |n, s, p| broker_rate(8, n, s, p), 64, 20000),
    ),
    bw(
        "broker_rate_b32",
        "broker 64 B messages, batch 32, 2 procs",
        "ib_write_bw -s 64",
        "Mpps",
        ">= 0.90",
        perftest("ib_write_bw", 5, "-s 64 -n 20000"),
        against(BROKER_SINK, |n, s, p| broker_rate(32, n, s, p), 64, 20000),
    ),
    lat(
        "broker_lat",
        "broker 64 B ping-pong, reply from the callback, half RTT, 2 procs",
        "ib_send_lat",
        "<= 1.30",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        against(BROKER_ECHO, broker_lat, 64, 1000),
    ),
    bw(
        "broker_all2all_2",
        "broker all-to-all 64 B, 2 brokers, 2 procs",
        "ib_send_bw -s 64",
        "Mpps",
        "reported",
        perftest("ib_send_bw", 5, "-s 64 -n 20000"),
        against(
            "BENCH peer broker-mesh --port PORT --servers 2 -n 10000",
            |n, s, p| broker_all_to_all(2, n, s, p),
            64,
            10000,
        ),
    ),
    bw(
        "broker_all2all_4",
        "broker all-to-all 64 B, 4 brokers, 4 procs",
        "ib_send_bw -s 64",
        "Mpps",
        "reported",
        perftest("ib_send_bw", 5, "-s 64 -n 20000"),
        against(
            "BENCH peer broker-mesh --port PORT --servers 4 -n 3000",
            |n, s, p| broker_all_to_all(4, n, s, p),
            64,
            3000,
        ),
    ),
    // The key-value store: a full round trip beside perftest's half.
    lat(
        "kv_get_lat_2p",
        "kv GET 16 B key, 64 B value (full RTT), 2 procs",
        "ib_send_lat (half RTT)",
        "<= 2.30",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        against(
            KV_SERVER,
            |n, s, p| kv_lat_remote(KvOp::Get, n, s, p),
            64,
            1000,
        ),
    ),
    lat(
        "kv_put_lat_2p",
        "kv PUT 16 B key, 64 B value (full RTT), 2 procs",
        "ib_send_lat (half RTT)",
        "<= 2.30",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        against(
            KV_SERVER,
            |n, s, p| kv_lat_remote(KvOp::Put, n, s, p),
            64,
            1000,
        ),
    ),
    lat(
        "kv_onesided_lat_2p",
        "kv one-sided GET 64 B (1 READ), 2 procs",
        "ib_read_lat",
        "<= 1.30",
        perftest("ib_read_lat", 5, "-s 64 -n 1000"),
        against(
            KV_SERVER,
            |n, s, p| kv_lat_remote(KvOp::GetOneSided, n, s, p),
            64,
            1000,
        ),
    ),
    lat(
        "kv_get_lat",
        "kv GET 16 B key, 64 B value (full RTT), 1 proc",
        "ib_send_lat (half RTT)",
        "reported",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        here(|n, s, p| kv_lat(KvOp::Get, 0, n, s, p), 64, 1000),
    ),
    lat(
        "kv_get_lat_crowd",
        "kv GET as above, 127 more clients connected",
        "ib_send_lat (half RTT)",
        "reported",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        here(|n, s, p| kv_lat(KvOp::Get, IDLE_CLIENTS, n, s, p), 64, 1000),
    ),
    lat(
        "kv_put_lat",
        "kv PUT 16 B key, 64 B value (full RTT), 1 proc",
        "ib_send_lat (half RTT)",
        "reported",
        perftest("ib_send_lat", 5, "-s 64 -n 1000"),
        here(|n, s, p| kv_lat(KvOp::Put, 0, n, s, p), 64, 1000),
    ),
    // One READ of a remembered key's block.
    lat(
        "kv_onesided_lat",
        "kv one-sided GET 64 B (1 READ), 1 proc",
        "ib_read_lat",
        "reported",
        perftest("ib_read_lat", 5, "-s 64 -n 1000"),
        here(|n, s, p| kv_lat(KvOp::GetOneSided, 0, n, s, p), 64, 1000),
    ),
    bw(
        "kv_get_bw_2p",
        "kv batch_get_with 64 KiB, 32 per batch, 2 procs",
        "ib_read_bw",
        "MiB/s",
        ">= 0.90",
        perftest("ib_read_bw", 4, "-s 65536 -n 500"),
        against(
            KV_SERVER,
            |n, s, p| kv_bw_remote(KvOp::Get, n, s, p),
            65536,
            500,
        ),
    ),
    bw(
        "kv_onesided_get_bw_2p",
        "kv one-sided batch GET 64 KiB, 32 per batch, 2 procs",
        "ib_read_bw",
        "MiB/s",
        ">= 0.90",
        perftest("ib_read_bw", 4, "-s 65536 -n 500"),
        against(
            KV_SERVER,
            |n, s, p| kv_bw_remote(KvOp::GetOneSided, n, s, p),
            65536,
            500,
        ),
    ),
    bw(
        "kv_put_bw_2p",
        "kv batch_put_with 64 KiB registered, 32 per batch, 2 procs",
        "ib_write_bw",
        "MiB/s",
        ">= 0.90",
        perftest("ib_write_bw", 4, "-s 65536 -n 500"),
        against(
            KV_SERVER,
            |n, s, p| kv_bw_remote(KvOp::Put, n, s, p),
            65536,
            500,
        ),
    ),
    bw(
        "kv_get_bw",
        "kv batch_get_with 64 KiB, 32 per batch, 1 proc",
        "ib_read_bw",
        "MiB/s",
        "reported",
        perftest("ib_read_bw", 4, "-s 65536 -n 500"),
        here(|n, s, p| kv_bw(KvOp::Get, n, s, p), 65536, 500),
    ),
    bw(
        "kv_onesided_get_bw",
        "kv one-sided batch GET 64 KiB, 32 per batch, 1 proc",
        "ib_read_bw",
        "MiB/s",
        "reported",
        perftest("ib_read_bw", 4, "-s 65536 -n 500"),
        here(|n, s, p| kv_bw(KvOp::GetOneSided, n, s, p), 65536, 500),
    ),
    bw(
        "kv_put_bw",
        "kv batch_put_with 64 KiB registered, 32 per batch, 1 proc",
        "ib_write_bw",
        "MiB/s",
        "reported",
        perftest("ib_write_bw", 4, "-s 65536 -n 500"),
        here(|n, s, p| kv_bw(KvOp::Put, n, s, p), 65536, 500),
    ),
    bw(
        "kv_mix",
        "kv 95/5 GET/PUT 64 B, 4 client threads, 1 proc",
        "ib_send_bw -s 64 (Mpps)",
        "Mops",
        "reported",
        perftest("ib_send_bw", 5, "-s 64 -n 20000"),
        here(kv_mix, 64, 4000),
    ),
    // kv_server and kv_client processes, as they are deployed.
    kv_procs(
        "kv_mix_1",
        "kv 95/5 GET/PUT 64 B, batches, 1 kv_client process",
        "-s 64 -q 1 -n 20000",
        1,
    ),
    kv_procs(
        "kv_mix_2",
        "kv 95/5 GET/PUT 64 B, batches, 2 kv_client processes",
        "-s 64 -q 2 -n 20000",
        2,
    ),
    kv_procs(
        "kv_mix_4",
        "kv 95/5 GET/PUT 64 B, batches, 4 kv_client processes",
        "-s 64 -q 4 -n 10000",
        4,
    ),
    // The kv_open API (the legacy client's menu option 3).
    kv_app(
        "kv_app_write_1024",
        "kv_set+kv_get 1 KiB (menu 3)",
        "ib_write_bw 1 KiB",
        "ib_write_bw",
        "-s 1024 -n 100",
        1024,
    ),
    kv_app(
        "kv_app_read_1024",
        "kv_set+kv_get 1 KiB (menu 3)",
        "ib_read_bw 1 KiB",
        "ib_read_bw",
        "-s 1024 -n 100",
        1024,
    ),
    kv_app(
        "kv_app_write_65536",
        "kv_set+kv_get 64 KiB (menu 3)",
        "ib_write_bw 64 KiB",
        "ib_write_bw",
        "-s 65536 -n 100",
        65536,
    ),
    kv_app(
        "kv_app_read_65536",
        "kv_set+kv_get 64 KiB (menu 3)",
        "ib_read_bw 64 KiB",
        "ib_read_bw",
        "-s 65536 -n 100",
        65536,
    ),
    kv_app(
        "kv_app_write_16777216",
        "kv_set+kv_get 16 MiB (menu 3)",
        "ib_write_bw 16 MiB",
        "ib_write_bw",
        "-s 16777216 -n 100",
        16777216,
    ),
    kv_app(
        "kv_app_read_16777216",
        "kv_set+kv_get 16 MiB (menu 3)",
        "ib_read_bw 16 MiB",
        "ib_read_bw",
        "-s 16777216 -n 100",
        16777216,
    ),
];
