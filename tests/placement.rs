//! Core placement from threads that are pinned already. A thread inherits
//! its spawner's affinity, so a reactor thread started by a pinned thread
//! sees one core as its own; choosing among that one would put every
//! reactor on the same core (a sender and receiver sharing one core run
//! at a small fraction of their rate). The choice
//! is among the process's cores, as first seen.
//!
//! Its own test binary: the first look at the cores is process-wide, and
//! must come from a thread nothing pinned.

use rdma_comm_core::reactor::{CorePreference, pin_current_thread, usable_cores};
use rdma_comm_core::runtime::{CoreChoice, CorePlan};

#[test]
fn a_thread_spawned_by_a_pinned_thread_still_spreads_over_the_process_cores() {
    let cores = usable_cores().to_vec();
    assert!(
        cores.len() >= 2,
        "this proof needs two usable cores, the machine gives {cores:?}"
    );
    let (first, second) = (cores[0], cores[1]);
    std::thread::spawn(move || {
        assert!(core_affinity::set_for_current(core_affinity::CoreId {
            id: first
        }));
        assert_eq!(
            core_affinity::get_core_ids().map(|ids| ids.len()),
            Some(1),
            "a pinned thread sees one core of its own"
        );
        std::thread::spawn(move || {
            // Inherits the one core; no such device, so no NUMA node: the
            // second reactor must still get the process's second core.
            let placement = pin_current_thread("no-such-device", CorePreference::NearDevice, 1);
            assert_eq!(placement.core, Some(second));
            let plan = CorePlan::choose("no-such-device", 2, &CoreChoice::NearDevice)
                .expect("two reactors fit on the process's two cores");
            assert_eq!(plan.cores, vec![Some(first), Some(second)]);
        })
        .join()
        .expect("the thread spawned by a pinned thread");
    })
    .join()
    .expect("the pinned thread");
}
