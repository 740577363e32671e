//! GPU-NIC matching on recorded sysfs trees of 8-GPU machines (tests/fixtures/topology/), and on
//! this machine's own tree.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use actorpipe::topology::{distance, materialize, Topology, CROSS_ROOT};

/// A sysfs tree written from a fixture, removed when dropped.
struct Tree(PathBuf);

impl Tree {
    fn new(fixture: &str) -> Tree {
        // Tests run in parallel and two of them may read the same fixture: each tree gets its
        // own directory, or one test's cleanup deletes the other's tree mid-write.
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "actorpipe-topology-{}-{}-{fixture}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let listing = std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/topology")
                .join(format!("{fixture}.txt")),
        )
        .expect("fixture");
        materialize(&listing, &dir).expect("materialize");
        Tree(dir)
    }

    fn topology(&self) -> Topology {
        Topology::read(&self.0).expect("read")
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn dgx1_four_nics_two_gpus_each_behind_their_switch() {
    let tree = Tree::new("dgx1_v100_4nic");
    let t = tree.topology();
    assert_eq!(
        t.gpus().len(),
        8,
        "the BMC's VGA device is not an NVIDIA GPU"
    );
    assert_eq!(t.nics().len(), 4);
    let pairs = t.gpu_nics();
    let nics: Vec<&str> = pairs.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(
        nics,
        ["mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1", "mlx5_2", "mlx5_2", "mlx5_3", "mlx5_3"]
    );
    // Each GPU's NIC shares its switch: two links up, two down.
    for (gpu, nic) in &pairs {
        let g = &t.devices[gpu];
        let n = &t.devices[&t.rdma[nic]];
        assert_eq!(distance(g, n), 4, "{gpu} -> {nic}");
    }
    // A GPU on socket 0 is farthest from socket 1's NICs.
    let order = t.nics_by_distance(t.gpus()[0]);
    assert_eq!(order[0], ("mlx5_0".to_string(), 4));
    // Same root complex, another switch: up to the root port and down again.
    assert_eq!(order[1], ("mlx5_1".to_string(), 8));
    assert_eq!(order[2].1, CROSS_ROOT);
}

#[test]
fn dgx_a100_eight_nics_one_per_gpu_and_storage_nics_left_alone() {
    let tree = Tree::new("dgx_a100_8nic");
    let t = tree.topology();
    assert_eq!(t.gpus().len(), 8, "NVSwitches (bridge class) are not GPUs");
    assert_eq!(t.nics().len(), 10);
    let pairs = t.gpu_nics();
    let nics: Vec<&str> = pairs.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(
        nics,
        ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
    );
    assert!(!nics.contains(&"mlx5_8") && !nics.contains(&"mlx5_9"));
    // Striping order for GPU 0: its own NIC, then its switch complex's other NIC.
    let order = t.nics_by_distance(t.gpus()[0]);
    assert_eq!(order[0].0, "mlx5_0");
    assert_eq!(order[1].0, "mlx5_1");
    assert!(order[1].1 > order[0].1 && order[1].1 < CROSS_ROOT);
}

#[test]
fn fewer_nics_than_gpus_still_spreads_evenly() {
    // The A100 tree with only the two storage HCAs: every GPU is equally far (another root
    // complex), so the eight split four and four.
    let tree = Tree::new("dgx_a100_8nic");
    let mut t = tree.topology();
    t.rdma
        .retain(|name, _| name == "mlx5_8" || name == "mlx5_9");
    let pairs = t.gpu_nics();
    let on_8 = pairs.iter().filter(|(_, n)| n == "mlx5_8").count();
    assert_eq!((on_8, pairs.len() - on_8), (4, 4));
}

#[test]
fn a_bad_fixture_line_is_refused() {
    let dir = std::env::temp_dir().join(format!("actorpipe-topology-bad-{}", std::process::id()));
    let err = materialize("pci 0000:00:00.0 0x0\n", &dir).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn this_machine_tree_reads() {
    // Whatever this host has (no GPU and no RDMA NIC on CI): reading must work and every GPU
    // found must get a NIC when there is one.
    let t = Topology::live().expect("/sys/bus/pci/devices");
    // Shown with --nocapture: how this machine's GPUs would be matched.
    eprint!("{}", t.report());
    let pairs = t.gpu_nics();
    if t.nics().is_empty() {
        assert!(pairs.is_empty());
    } else {
        assert_eq!(pairs.len(), t.gpus().len());
    }
}

#[test]
fn the_gpu_machine_two_h200_no_rdma_nic() {
    // Recorded on the GPU machine (docs/ibv.md): a flat VM bus, so every device is two links
    // from every other, and no RDMA NIC to assign.
    let tree = Tree::new("gpu_vm_2xh200");
    let t = tree.topology();
    let gpus = t.gpus();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0].address, "0000:00:06.0");
    assert!(t.nics().is_empty());
    assert!(t.gpu_nics().is_empty());
    let net = &t.devices["0000:00:03.0"];
    assert_eq!(distance(gpus[0], net), 2);
    assert!(t.report().contains("net: gpu 0000:00:07.0 -> 0000:00:03.0"));
}

#[test]
fn a_gpus_nics_for_striping_start_with_its_own_and_stay_on_its_root_complex() {
    let tree = Tree::new("dgx1_v100_4nic");
    let t = tree.topology();
    let gpus: Vec<String> = t.gpus().iter().map(|g| g.address.clone()).collect();
    // GPU 0: its switch's NIC, then the other NIC of its root complex; socket 1's are left out.
    assert_eq!(t.nics_for_gpu(&gpus[0], 8), ["mlx5_0", "mlx5_1"]);
    // GPU 3 shares mlx5_1's switch: that one first.
    assert_eq!(t.nics_for_gpu(&gpus[3], 8), ["mlx5_1", "mlx5_0"]);
    assert_eq!(t.nics_for_gpu(&gpus[7], 1), ["mlx5_3"]);
    assert!(t.nics_for_gpu("0000:ff:00.0", 8).is_empty());

    // Only the A100 tree's storage HCAs, on another root complex: each GPU gets the one
    // `assign` spreads it to, and no second to stripe over.
    let tree = Tree::new("dgx_a100_8nic");
    let mut t = tree.topology();
    let first = t.nics_for_gpu(&t.gpus()[0].address.clone(), 8);
    assert_eq!(first[0], "mlx5_0");
    assert_eq!(first.get(1).map(String::as_str), Some("mlx5_1"));
    t.rdma
        .retain(|name, _| name == "mlx5_8" || name == "mlx5_9");
    let lists: Vec<Vec<String>> = t
        .gpus()
        .iter()
        .map(|g| t.nics_for_gpu(&g.address, 8))
        .collect();
    assert!(lists.iter().all(|l| l.len() == 1), "{lists:?}");
    let on_8 = lists.iter().filter(|l| l[0] == "mlx5_8").count();
    assert_eq!(on_8, 4, "{lists:?}");
}
