//! Mixed batches: GETs and PUTs of one caller in flight together, for
//! throughput (a closed loop of single calls waits a round trip per
//! operation).

use std::cell::RefCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use crate::kv::proto::{is_inline, Op, Request};
use crate::kv::{check_key, Result};

use super::{Client, Outgoing, BATCH_WINDOW};

/// One operation of a mixed batch ([`Client::batch_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchOp<'a> {
    Get(&'a [u8]),
    /// A key and its new value.
    Put(&'a [u8], &'a [u8]),
}

impl BatchOp<'_> {
    /// Whether it travels in one request, so it can be pipelined (a PUT
    /// whose key and value do not fit one goes alone).
    fn fits_a_request(&self) -> bool {
        match *self {
            BatchOp::Get(_) => true,
            BatchOp::Put(key, value) => is_inline(key.len(), value.len()),
        }
    }
}

impl Client {
    /// GETs and PUTs with up to 64 requests in flight, sent in the order
    /// given, so each sees the ones before it (the server takes one
    /// client's requests in order). `each` gets every operation's index
    /// and result, once, on the calling thread, in no particular order: a
    /// GET's value, lent for the call under [`Client::get_with`]'s rule,
    /// and its version; a PUT's new version, with an empty value. A value
    /// the server leases is READ when its reply is taken; a PUT whose key
    /// and value do not fit in a request goes alone, once the operations
    /// before it are answered.
    ///
    /// Should `each` panic, the batch is still finished without it (every
    /// reply taken, every lease given back), and then the panic goes on.
    pub fn batch_with(
        &self,
        ops: &[BatchOp<'_>],
        mut each: impl FnMut(usize, Result<(&[u8], u64)>),
    ) {
        let mut panic = None;
        // Shared by the reply handling and the errors: never called
        // inside itself.
        let answer = RefCell::new(|i: usize, r: Result<(&[u8], u64)>| {
            if panic.is_none() {
                panic = catch_unwind(AssertUnwindSafe(|| each(i, r))).err();
            }
        });
        let mut base = 0;
        while base < ops.len() {
            let run = ops[base..]
                .iter()
                .take_while(|op| op.fits_a_request())
                .count();
            if run == 0 {
                if let BatchOp::Put(key, value) = ops[base] {
                    answer.borrow_mut()(base, self.put(key, value).map(|v| (&[][..], v)));
                }
                base += 1;
                continue;
            }
            let run_ops = &ops[base..base + run];
            self.pipelined(
                run,
                BATCH_WINDOW,
                |i| match run_ops[i] {
                    BatchOp::Get(key) => {
                        check_key(key)?;
                        Ok(Outgoing::new(Request::new(Op::Get, 0), key, &[]))
                    }
                    BatchOp::Put(key, value) => {
                        check_key(key)?;
                        self.check_value(value)?;
                        let mut req = Request::new(Op::Write, 0);
                        req.value_len = value.len() as u64;
                        Ok(Outgoing::new(req, key, value))
                    }
                },
                |i, reply, payload| {
                    match run_ops[i] {
                        BatchOp::Put(..) => answer.borrow_mut()(base + i, Ok((&[], reply.version))),
                        BatchOp::Get(key) if reply.remote => {
                            self.replies.recycle(payload);
                            return self.fetch(key, &reply, |v, version| {
                                answer.borrow_mut()(base + i, Ok((v, version)))
                            });
                        }
                        BatchOp::Get(_) => {
                            answer.borrow_mut()(base + i, Ok((&payload, reply.version)))
                        }
                    }
                    self.replies.recycle(payload);
                    Ok(())
                },
                |i, result| {
                    if let Err(e) = result {
                        answer.borrow_mut()(base + i, Err(e));
                    }
                },
            );
            base += run;
        }
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }
}
