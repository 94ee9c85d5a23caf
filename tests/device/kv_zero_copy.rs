//! Values moved by the NIC alone between registered client memory and the
//! server: no user-space copy of the value on the client's side.

use snowrdma::costs::{self, Counter};
use snowrdma::kv::{Client, KvError};

use crate::kv::kv_server;

/// Payload bytes the calling thread copied while `f` ran.
fn copied_by_me<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = costs::this_thread();
    let out = f();
    (
        out,
        costs::this_thread()
            .since(&before)
            .get(Counter::CopiedBytes),
    )
}

#[test]
#[ignore = "needs an RDMA device"]
fn kv_values_in_registered_memory_move_without_a_copy() {
    let (_server, addr) = kv_server(false);
    let client = Client::connect(addr).unwrap();
    // One value staged through the request buffer (one round trip), one
    // larger than it (a target the server allocates first).
    let staged = client.server_info().request_buf_len as usize / 2;
    let allocated = 3 * client.server_info().request_buf_len as usize + 123;
    for (i, len) in [staged, allocated].into_iter().enumerate() {
        let key = format!("zero-copy-{i}");
        let mut mem = client.register(2 * len).unwrap();
        for (j, b) in mem.as_mut_slice()[..len].iter_mut().enumerate() {
            *b = (j * 7 + i) as u8;
        }
        let want = mem.as_slice()[..len].to_vec();
        let (version, copied) = copied_by_me(|| client.put(key.as_bytes(), &mem.as_slice()[..len]));
        let version = version.unwrap();
        assert!(copied < 1024, "{len}-byte PUT copied {copied} bytes");

        // Into the second half of the same memory: READ straight there.
        let (got, copied) = copied_by_me(|| {
            let (_, dst) = mem.as_mut_slice().split_at_mut(len);
            client.get_into(key.as_bytes(), dst)
        });
        assert_eq!(got.unwrap(), (len, version));
        assert!(copied < 1024, "{len}-byte GET copied {copied} bytes");
        assert_eq!(&mem.as_slice()[len..], &want[..], "{len}-byte value");

        // A plain buffer still works, through the bounce buffer (a copy).
        let mut plain = vec![0u8; len];
        let (got, copied) = copied_by_me(|| client.get_into(key.as_bytes(), &mut plain));
        assert_eq!(got.unwrap(), (len, version));
        assert!(copied >= len as u64);
        assert_eq!(plain, want);
    }
    assert!(matches!(
        client.register(0),
        Err(KvError::InvalidArgument(_))
    ));
}

#[test]
#[ignore = "needs an RDMA device"]
fn small_gets_and_puts_copy_only_what_they_must() {
    let (_server, addr) = kv_server(false);
    let client = Client::connect(addr).unwrap();
    let key = b"a sixteen B key!";
    let value = [0x5a_u8; 64];
    client.put(key, &value).unwrap();
    let mut buf = [0u8; 64];
    client.get_into(key, &mut buf).unwrap();
    let before = costs::snapshot();
    for _ in 0..10 {
        buf.fill(0);
        assert_eq!(client.get_into(key, &mut buf).unwrap().0, 64);
        assert_eq!(buf, value);
    }
    let d = costs::snapshot().since(&before);
    // Both ends are in this process. The client's request (header and key)
    // goes inline from where its parts are, and the server copies it out
    // of its ring once; the server's reply (header and the value, from its
    // block) goes inline too, and its value lands in `buf` straight from
    // the client's ring: one copy on each side per GET.
    assert_eq!(d.get(Counter::Copies), 20, "{d:?}");
    let request_bytes = (d.get(Counter::CopiedBytes) - 640) / 10;
    assert_eq!(
        d.get(Counter::CopiedBytes),
        640 + 10 * request_bytes,
        "{d:?}"
    );
    assert!((16..64).contains(&request_bytes), "{d:?}");

    let before = costs::snapshot();
    for _ in 0..10 {
        client.put(key, &value).unwrap();
    }
    let d = costs::snapshot().since(&before);
    // The request (header, key and value) goes inline from where its parts
    // are, and its reply, a header alone, is filed from the client's ring;
    // the server copies the key and value from its ring straight into
    // their block: one copy per PUT, on the server.
    assert_eq!(d.get(Counter::Copies), 10, "{d:?}");
    assert_eq!(d.get(Counter::CopiedBytes), 10 * (16 + 64), "{d:?}");
    client.get_into(key, &mut buf).unwrap();
    assert_eq!(buf, value);
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_batch_of_large_values_takes_a_doorbell_per_phase_and_copies_none() {
    const KEYS: usize = 32;
    const LEN: usize = 64 << 10;
    let (_server, addr) = kv_server(false);
    let client = Client::connect(addr).unwrap();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("batch-{i}")).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    // Each key's value in registered memory, a pattern of its own.
    let mut mem = client.register(KEYS * LEN).unwrap();
    for (j, b) in mem.as_mut_slice().iter_mut().enumerate() {
        *b = (j / LEN * 31 + j % 251) as u8;
    }
    let value = |i: usize| &mem.as_slice()[i * LEN..(i + 1) * LEN];
    let pairs: Vec<(&[u8], &[u8])> = (0..KEYS).map(|i| (key_refs[i], value(i))).collect();
    let get_all = || {
        let mut seen = [false; KEYS];
        client.batch_get_with(&key_refs, |i, r| {
            let (v, _) = r.unwrap();
            assert!(v == value(i), "value {i}");
            seen[i] = true;
        });
        assert!(seen.iter().all(|&s| s), "a key got no answer");
    };
    // Warm-up: the bounce buffer is registered, the server's slots filled.
    assert!(client.batch_put(&pairs).iter().all(Result::is_ok));
    get_all();

    let before = costs::this_thread();
    let versions = client.batch_put(&pairs);
    let d = costs::this_thread().since(&before);
    assert!(versions.iter().all(Result::is_ok), "{versions:?}");
    // 32 WRITEs from the caller's memory, each with its request, with one
    // doorbell (a credit owed to the server may ride along).
    assert_eq!(d.get(Counter::SendDoorbells), 1, "{d:?}");
    assert!(d.get(Counter::CopiedBytes) < LEN as u64, "{d:?}");
    assert_eq!(d.get(Counter::WireBytes) / LEN as u64, KEYS as u64, "{d:?}");

    let before = costs::this_thread();
    get_all();
    let d = costs::this_thread().since(&before);
    // The requests, the READs of the leased values, the release of the
    // leases: a doorbell each; the values are lent where they landed.
    assert_eq!(d.get(Counter::SendDoorbells), 3, "{d:?}");
    assert!(d.get(Counter::CopiedBytes) < LEN as u64, "{d:?}");
}
