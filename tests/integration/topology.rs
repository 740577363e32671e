//! GPU-NIC matching on recorded sysfs trees of 8-GPU machines (tests/fixtures/topology/), and on
//! this machine's own tree.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use actorpipe::internal::topology::{distance, materialize, Topology, CROSS_ROOT};

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

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// The DGX-1 tree (removed when the first is dropped), read, and its GPUs' addresses.
fn dgx1() -> (Tree, Topology, Vec<String>) {
    let tree = Tree::new("dgx1_v100_4nic");
    let t = tree.topology();
    let gpus = t.gpus().iter().map(|g| g.address.clone()).collect();
    (tree, t, gpus)
}

#[test]
fn each_gpu_takes_its_own_nic_then_its_root_complexs_among_a_channels_devices() {
    let (_tree, t, gpus) = dgx1();
    // A channel on all four HCAs (the first device mlx5_0, then 1, 2, 3): each GPU its switch's
    // NIC, then the other NIC of its socket; never one across the sockets.
    let devices = names(&["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]);
    let chosen: Vec<Vec<usize>> = gpus
        .iter()
        .map(|g| t.devices_for_gpu(g, &devices))
        .collect();
    assert_eq!(
        chosen,
        [
            vec![0, 1],
            vec![0, 1],
            vec![1, 0],
            vec![1, 0],
            vec![2, 3],
            vec![2, 3],
            vec![3, 2],
            vec![3, 2]
        ]
    );
    // CUDA spells the address in capitals with an 8-digit domain.
    let cuda_spelling = format!("0000{}", gpus[7].to_ascii_uppercase());
    assert_eq!(t.devices_for_gpu(&cuda_spelling, &devices), [3, 2]);

    // A channel on two of them, listed in another order: positions in the channel's list, and
    // the GPUs spread over those two only (four each, by socket).
    let devices = names(&["mlx5_3", "mlx5_1"]);
    let chosen: Vec<Vec<usize>> = gpus
        .iter()
        .map(|g| t.devices_for_gpu(g, &devices))
        .collect();
    assert_eq!(chosen[..4], [vec![1], vec![1], vec![1], vec![1]]);
    assert_eq!(chosen[4..], [vec![0], vec![0], vec![0], vec![0]]);

    // Devices the tree does not place (simulated ones, unless placed): no choice, so the
    // channel uses every device.
    let sims = names(&["sim0", "sim1"]);
    assert!(gpus.iter().all(|g| t.devices_for_gpu(g, &sims).is_empty()));
    assert!(t.devices_for_gpu("0000:ff:00.0", &devices).is_empty());
}

#[test]
fn simulated_devices_are_placed_by_name() {
    // sim0 where socket 1's mlx5_2 is, sim1 where socket 0's mlx5_0 is.
    let (_tree, t, gpus) = dgx1();
    let t = t
        .place("sim0", "0000:88:00.0")
        .place("sim1", "0000:08:00.0");
    let devices = names(&["sim0", "sim1"]);
    assert_eq!(t.devices_for_gpu(&gpus[0], &devices), [1]);
    assert_eq!(t.devices_for_gpu(&gpus[5], &devices), [0]);
}

#[test]
fn dgx_a100_gpu_n_starts_on_mlx5_n_and_never_on_a_storage_hca() {
    let tree = Tree::new("dgx_a100_8nic");
    let t = tree.topology();
    let devices: Vec<String> = (0..10).map(|i| format!("mlx5_{i}")).collect();
    for (n, g) in t.gpus().iter().enumerate() {
        let chosen = t.devices_for_gpu(&g.address, &devices);
        assert_eq!(chosen.first(), Some(&n), "GPU {n}: {chosen:?}");
        assert!(
            !chosen.contains(&8) && !chosen.contains(&9),
            "GPU {n}: {chosen:?}"
        );
    }
}

/// Which links each GPU's tensors take once paired with a peer (feature `ibv`: the channel's
/// table, [`actorpipe::internal::backend::ibv::channel::placement::GpuLinks`]).
#[cfg(feature = "ibv")]
#[test]
fn a_gpus_tensors_take_the_links_of_its_nics_that_the_peer_reaches() {
    use actorpipe::internal::backend::ibv::channel::placement::GpuLinks;
    let (_tree, t, gpus) = dgx1();
    let devices = names(&["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]);
    let table = GpuLinks::compute(&t, &devices, &gpus);
    assert_eq!(table.0[3], [1, 0]);
    // Every further device paired (links 1, 2, 3 are mlx5_1, 2, 3).
    let all = [0, 1, 2];
    assert_eq!(table.links(Some(0), &all), [0, 1]);
    assert_eq!(table.links(Some(6), &all), [3, 2]);
    // A peer with only three devices: mlx5_3 has no partner, so GPU 6 keeps mlx5_2 alone.
    assert_eq!(table.links(Some(6), &[0, 1]), [2]);
    // Host memory, and a GPU the table does not know: every link.
    assert_eq!(table.links(None, &all), [0, 1, 2, 3]);
    assert_eq!(table.links(Some(8), &all), [0, 1, 2, 3]);
    // Unplaced (simulated) devices: an empty entry per GPU, so every link.
    let sims = GpuLinks::compute(&t, &names(&["sim0", "sim1"]), &gpus);
    assert!(sims.0.iter().all(Vec::is_empty));
    assert_eq!(sims.links(Some(0), &[0]), [0, 1]);
}
