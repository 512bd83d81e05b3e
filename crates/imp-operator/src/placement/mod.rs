//! What every controller that places a VM shares: the VM controller today, the warm pools'
//! members and migrations next. [`schedule`] picks a node (pure) from the per-node usage
//! [`ledger`] keeps; [`reservation`] is the Pod bound to the node that makes kube-scheduler,
//! the kubelet and ResourceQuota count a VM ([`quantity`] renders its sizes); [`fencing`] says
//! whether a silent node's VMs are surely stopped, from its agent's Lease. None of it writes a
//! VM: the controllers apply what it decides.

pub mod fencing;
pub mod ledger;
pub mod quantity;
pub mod reservation;
pub mod schedule;
