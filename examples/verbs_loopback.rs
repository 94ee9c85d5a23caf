//! The verbs layer on one device: two RC queue pairs connected by hand, an
//! RDMA WRITE from one into the other's memory, checked byte for byte.
//!
//!   cargo run --example verbs_loopback     (needs an RDMA device)

use std::time::Duration;

use snowrdma::verbs::{AccessFlags, Context, QpOptions, SendOp, SendRequest};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::open(None)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16, None)?;
    let a = pd.create_rc_qp(&cq, &cq, &QpOptions::default())?;
    let b = pd.create_rc_qp(&cq, &cq, &QpOptions::default())?;
    // Out of band in a real program: each side sends the other its QpInfo.
    let (a_info, b_info) = (a.local_info()?, b.local_info()?);
    let a = a.connect(&b_info)?;
    let _b = b.connect(&a_info)?;

    let mut src = pd.allocate(4096, AccessFlags::LOCAL_WRITE)?;
    let dst = pd.allocate(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    src.as_mut_slice()[..5].copy_from_slice(b"hello");
    let sge = src.sge(..5);
    // SAFETY: `src` is neither written nor freed until the completion below.
    unsafe {
        a.post_send(&[SendRequest::new(
            1,
            SendOp::Write(dst.remote().at(0)),
            &[sge],
        )])?
    };
    let wc = cq.wait_one(Duration::from_secs(5))?;
    println!("completion {:?}", wc.status());
    assert_eq!(&dst.as_slice()[..5], b"hello");
    println!("wrote \"hello\" through the device");
    Ok(())
}
