//! ibv (transport and channel) on real HCAs. Each trial is reported as ignored ("skipped: no RDMA device") where
//! libibverbs finds no device, which is every machine this project has run on so far; on a
//! machine with an active port the same binary runs them for real.

use std::sync::Arc;

use actorpipe::internal::backend::ibv::{
    self as verbs, Access, Opcode, QpCaps, RecvWr, SendOp, SendWr, Sge, Status,
};
use actorpipe::transport::Ibv;
use libtest_mimic::{Arguments, Failed, Trial};

/// Why the hardware trials cannot run here, if they cannot.
fn no_device() -> Option<String> {
    match verbs::hw::devices() {
        Err(e) => Some(e.to_string()),
        Ok(d) if !d.iter().any(|d| d.ports.iter().any(|p| p.active)) => {
            Some("no RDMA port is active".into())
        }
        Ok(_) => None,
    }
}

fn first_device() -> Result<Box<dyn verbs::Device>, Failed> {
    let devs = verbs::hw::devices().map_err(|e| e.to_string())?;
    let d = devs
        .iter()
        .find(|d| d.ports.iter().any(|p| p.active))
        .ok_or("no active port")?;
    let port = d.ports.iter().find(|p| p.active).expect("found above").port;
    Ok(verbs::hw::open(&d.name, port, 0).map_err(|e| e.to_string())?)
}

/// Two queue pairs of one HCA connected to each other: a write with immediate lands, the
/// 32-byte minimum and keys behave as on the simulated device.
fn loopback_write_with_immediate() -> Result<(), Failed> {
    let dev = first_device()?;
    let mut src: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    let mut dst = vec![0u8; 4096];
    // SAFETY: both buffers outlive their registrations (dropped first, below).
    let ms = unsafe { dev.register(src.as_mut_ptr(), src.len(), Access::LOCAL) }?;
    // SAFETY: as above.
    let md = unsafe { dev.register(dst.as_mut_ptr(), dst.len(), Access::REMOTE_WRITE) }?;
    let mut a = dev.create_qp(QpCaps::default())?;
    let mut b = dev.create_qp(QpCaps::default())?;
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb)?;
    b.connect(&ea)?;
    b.post_recv(&RecvWr {
        wr_id: 9,
        local: Sge {
            addr: 0,
            len: 0,
            lkey: 0,
        },
    })?;
    a.post_send(&SendWr {
        wr_id: 1,
        op: SendOp::WriteImm {
            remote_addr: md.addr() + 64,
            rkey: md.rkey(),
            imm: 77,
        },
        local: ms.sge(ms.addr(), 1000).ok_or("sge")?,
    })?;
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while out.len() < 2 && std::time::Instant::now() < deadline {
        a.poll(&mut out, 4)?;
        b.poll(&mut out, 4)?;
    }
    let send = out
        .iter()
        .find(|c| c.opcode == Opcode::Write)
        .ok_or("no send completion")?;
    let recv = out
        .iter()
        .find(|c| c.opcode == Opcode::Recv)
        .ok_or("no receive completion")?;
    if send.status != Status::Success || recv.imm != Some(77) || recv.byte_len != 1000 {
        return Err(format!("completions {out:?}").into());
    }
    drop((ms, md));
    if dst[64..1064] != src[..1000] {
        return Err("bytes differ".into());
    }
    Ok(())
}

/// The ibv transport between two contexts of this process over the real HCA.
fn transport_round_trip() -> Result<(), Failed> {
    round_trip(false)
}

/// The ibv channel (over the ibv transport) between two contexts of this process over the real
/// HCA: a tensor by RDMA write into the receiver's registered buffer.
fn channel_round_trip() -> Result<(), Failed> {
    round_trip(true)
}

fn round_trip(with_channel: bool) -> Result<(), Failed> {
    let system = actix::System::new();
    system.block_on(async {
        use actorpipe::channel::IbvChannel;
        use actorpipe::*;
        let b = || {
            let ibv = Ibv::hardware().auto_listen("ibv://127.0.0.1:0");
            let b = Context::builder()
                .without("shm")
                .transport(Arc::new(ibv.clone()));
            if with_channel {
                b.channel(Arc::new(IbvChannel::new(ibv)))
                    .only_channels(&["ibv"])
            } else {
                b.only_channels(&["basic"])
            }
        };
        let server = b().start();
        let (to, mut accepted) = inbox::<Accepted>();
        let l = server
            .send(Listen::new(["tcp://127.0.0.1:0"], to))
            .await
            .map_err(|e| e.to_string())??;
        let tx = b()
            .start()
            .send(Connect::new(&l.urls[0]))
            .await
            .map_err(|e| e.to_string())??;
        let rx = accepted.recv().await.ok_or("no pipe")?.pipe;
        let info = tx.send(GetInfo).await.map_err(|e| e.to_string())?;
        let channel = if with_channel { "ibv" } else { "basic" };
        if info.transport != "ibv" || info.channels[0].name != channel {
            return Err(
                format!("negotiated {} and {}", info.transport, info.channel_list()).into(),
            );
        }
        let data = vec![5u8; 3 << 20];
        let w = tx.send(Write::new(
            Message::new().with_tensor(Tensor::cpu(data.clone())),
        ));
        let r = rx.send(Receive::new()).await.map_err(|e| e.to_string())?;
        r.result?;
        w.await.map_err(|e| e.to_string())?.result?;
        if r.message.tensors[0].buffer.as_cpu() != Some(&data[..]) {
            return Err("tensor differs".into());
        }
        Ok(())
    })
}

fn main() {
    let args = Arguments::from_args();
    let skip = no_device();
    let trial = |name: &'static str, f: fn() -> Result<(), Failed>| {
        let t = Trial::test(name, f);
        match &skip {
            Some(why) => t
                .with_ignored_flag(true)
                .with_kind(format!("skipped: {why}")),
            None => t,
        }
    };
    let trials = vec![
        trial(
            "loopback_write_with_immediate",
            loopback_write_with_immediate,
        ),
        trial("transport_round_trip", transport_round_trip),
        trial("channel_round_trip", channel_round_trip),
    ];
    libtest_mimic::run(&args, trials).exit();
}
