//! Admission rules in Rust: everything the webhook checks, including what CEL cannot express
//! (address arithmetic, cron fields, duration parsing, uniqueness). Reference existence is not
//! checked here: that is the controller's, since objects may appear later.
//!
//! Every error names the field path and says what is allowed.

use std::collections::BTreeSet;
use std::fmt;
use std::net::Ipv4Addr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{EnvVar, Toleration};

use crate::duration::GoDuration;
use crate::ipv4::Ipv4Cidr;
use crate::network::ImpNetworkSpec;
use crate::shared::{Probe, ProbeSpec, RestartPolicy};
use crate::snapshot::{ImpVMMigrationSpec, ImpVMSnapshotSpec, StorageType};
use crate::{
    ClusterImpConfig, ClusterImpNodeProfileSpec, ImpVMClassSpec, ImpVMSpec, ImpVMTemplateSpec,
};

mod pools;
pub use pools::{CLAIM_BOOTED, CLAIM_CLASS, runner_pool, warm_claim, warm_pool};

/// One rejected field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the field, e.g. `spec.expireAfter`.
    pub path: String,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every rejected field of one object, in the order found.
#[derive(Clone, Debug, Default, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors(pub Vec<FieldError>);

/// Two checks of one object as one result: every field either refused, the first's first.
pub fn both(
    first: Result<(), ValidationErrors>,
    second: Result<(), ValidationErrors>,
) -> Result<(), ValidationErrors> {
    let mut all = first.err().unwrap_or_default();
    all.0.extend(second.err().unwrap_or_default().0);
    if all.0.is_empty() { Ok(()) } else { Err(all) }
}

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&parts.join("; "))
    }
}

impl ValidationErrors {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError {
            path: path.into(),
            message: message.into(),
        });
    }

    fn into_result(self) -> Result<(), ValidationErrors> {
        if self.0.is_empty() { Ok(()) } else { Err(self) }
    }
}

/// Minimum non-zero expireAfter.
pub const MIN_EXPIRE_AFTER: Duration = Duration::from_secs(60);
/// Minimum idleTimeout.
pub const MIN_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// A clone of a snapshot takes its own identity (clock, names, address) through its agent.
pub const CLONE_NEEDS_AGENT: &str = "a clone takes its own identity through the guest agent, which spec.guestAgent.enabled: false turns off";

/// Probes run in the guest (exec, and HTTP from the guest to itself) through its agent. In-guest
/// probes beside `guestAgent.enabled: false` are accepted at admission, as the Go project
/// accepts them (its manifests apply unchanged); the node agent fails such a VM at boot with
/// InvalidSpec saying this.
pub const PROBES_NEED_AGENT: &str = "startupProbe, readinessProbe and livenessProbe run through the guest agent, which spec.guestAgent.enabled: false turns off (httpCheck, from the node, still works)";

/// Validates an ImpVM spec.
pub fn vm(spec: &ImpVMSpec) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    match (&spec.class_ref, &spec.template_ref) {
        (Some(_), Some(_)) => e.push(
            "spec",
            "exactly one of classRef or templateRef may be set, got both",
        ),
        (None, None) => e.push("spec", "one of classRef or templateRef is required"),
        (Some(c), None) => {
            non_empty(&mut e, "spec.classRef.name", &c.name);
            if spec.inherited.image.as_deref().is_none_or(str::is_empty) {
                e.push(
                    "spec.image",
                    "is required when spec.classRef is used without a template",
                );
            }
        }
        (None, Some(t)) => non_empty(&mut e, "spec.templateRef.name", &t.name),
    }
    if let Some(image) = &spec.inherited.image {
        image_ref(&mut e, "spec.image", image);
    }
    for (field, layer) in [
        ("spec.runnerLayer", &spec.inherited.runner_layer),
        ("spec.ciliumLayer", &spec.inherited.cilium_layer),
    ] {
        if let Some(l) = layer {
            image_ref(&mut e, field, l);
        }
    }
    if let Some(n) = &spec.network_ref {
        non_empty(&mut e, "spec.networkRef.name", &n.name);
    }
    if let Some(d) = &spec.inherited.expire_after {
        expire_after(&mut e, "spec.expireAfter", d);
    }
    if let Some(d) = &spec.idle_timeout {
        match d.parse() {
            Ok(v) if v >= MIN_IDLE_TIMEOUT => {}
            Ok(_) => e.push("spec.idleTimeout", format!("must be at least 10s, got {d}")),
            Err(err) => e.push("spec.idleTimeout", err.to_string()),
        }
    }
    env(&mut e, "spec.env", &spec.env);
    object_names(&mut e, spec);
    inherited(
        &mut e,
        &spec.tolerations,
        spec.inherited.probes.as_ref(),
        spec.inherited.restart_policy.as_ref(),
    );
    if let Some(n) = &spec.node_name {
        dns_subdomain(&mut e, "spec.nodeName", n);
    }
    if spec.snapshot_ref.is_some()
        && spec
            .inherited
            .guest_agent
            .as_ref()
            .is_some_and(|a| !a.is_enabled())
    {
        e.push("spec.snapshotRef", CLONE_NEEDS_AGENT);
    }
    e.into_result()
}

/// Admission warnings for an ImpVM that is valid but may not do what the user expects.
pub fn vm_warnings(spec: &ImpVMSpec) -> Vec<String> {
    let mut w = Vec::new();
    if spec.desired_state == crate::shared::VmDesiredState::ScaleToZero
        && spec.idle_timeout.is_none()
    {
        w.push("spec.idleTimeout is unset: a ScaleToZero VM suspends after the default 5m without traffic".to_owned());
    }
    if spec.desired_state == crate::shared::VmDesiredState::ScaleToZero
        && spec.network_ref.is_none()
    {
        w.push("spec.networkRef is unset: a ScaleToZero VM without a network has no traffic to count or to wake it, so it runs and never suspends by itself".to_owned());
    }
    if spec.reschedule_on_node_loss && spec.lifecycle == crate::shared::VmLifecycle::Ephemeral {
        w.push("spec.rescheduleOnNodeLoss only affects persistent VMs; ephemeral VMs are always rescheduled".to_owned());
    }
    if spec.snapshot_ref.is_some() {
        let set = [
            ("spec.env", !spec.env.is_empty()),
            ("spec.envFrom", !spec.env_from.is_empty()),
            ("spec.userData", spec.user_data.is_some()),
        ];
        for (field, _) in set.into_iter().filter(|(_, on)| *on) {
            w.push(format!("{field} {RESTORE_KEEPS_ITS_OWN}"));
        }
    }
    w
}

/// The warning on a VM restored from a snapshot that sets what only a boot applies.
pub const RESTORE_KEEPS_ITS_OWN: &str = "is not applied to a VM restored from a snapshot (spec.snapshotRef): its workload runs on from the snapshot's memory, with the environment and user data of the VM the snapshot was taken of; create the VM without spec.snapshotRef to boot with them";

/// Validates an update of an ImpVM: the rules of [`vm`] plus what may not change.
///
/// `spec.nodeName` may be cleared (the operator and agent do that) and set when empty, but not
/// moved from one node to another by an update: a move is a migration.
pub fn vm_update(old: &ImpVMSpec, new: &ImpVMSpec) -> Result<(), ValidationErrors> {
    vm_update_moving(old, new, None)
}

/// [`vm_update`] of a VM whose stored status holds `moving`: the move's commit, which sets
/// `spec.nodeName` from its source to its target once the source's agent says the target
/// holds the VM's files (`Sent`), is the one change of node allowed (docs/migration.md).
pub fn vm_update_moving(
    old: &ImpVMSpec,
    new: &ImpVMSpec,
    moving: Option<&crate::vm::VmMove>,
) -> Result<(), ValidationErrors> {
    let mut e = match vm(new) {
        Ok(()) => ValidationErrors::default(),
        Err(e) => e,
    };
    if let (Some(a), Some(b)) = (&old.node_name, &new.node_name)
        && a != b
        && !moving.is_some_and(|m| {
            m.phase == crate::vm::MovePhase::Sent && &m.source == a && &m.target == b
        })
    {
        e.push(
            "spec.nodeName",
            format!(
                "cannot move from {a} to {b}; clear it to reschedule or create an ImpVMMigration"
            ),
        );
    }
    if let (Some(node), Some(_)) = (&old.node_name, &new.node_name) {
        for field in fixed_once_placed(old, new) {
            e.push(
                field,
                format!(
                    "cannot change while the VM is placed on node {node} (it was booked with the \
                     old value); delete and recreate the VM to change it"
                ),
            );
        }
    }
    e.into_result()
}

/// The fields of a placed VM's spec that changed from `old` to `new` and that a placed VM
/// cannot take: what it was networked or restored with, and for an ephemeral VM (a job, never
/// restarted for an edit) or a clone (restored with its snapshot's size) what it was sized
/// with. (Image, env, envFrom, userData, probes,
/// restartPolicy and expireAfter are rolled into its booking by the operator; a persistent
/// VM's new classRef or templateRef places it anew.)
fn fixed_once_placed(old: &ImpVMSpec, new: &ImpVMSpec) -> Vec<&'static str> {
    let mut changed = Vec::new();
    let mut check = |field, differs: bool| {
        if differs {
            changed.push(field);
        }
    };
    // A clone (snapshotRef) is restored on its snapshot's node with the snapshot's size.
    let persistent = [old, new]
        .iter()
        .all(|s| s.lifecycle == crate::shared::VmLifecycle::Persistent && s.snapshot_ref.is_none());
    check(
        "spec.classRef",
        !persistent && old.class_ref != new.class_ref,
    );
    check(
        "spec.templateRef",
        !persistent && old.template_ref != new.template_ref,
    );
    check("spec.networkRef", old.network_ref != new.network_ref);
    check(
        "spec.networkGroup",
        old.inherited.network_group != new.inherited.network_group,
    );
    check("spec.lifecycle", old.lifecycle != new.lifecycle);
    check("spec.snapshotRef", old.snapshot_ref != new.snapshot_ref);
    changed
}

/// Validates an ImpVMClass spec.
pub fn class(spec: &ImpVMClassSpec) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    if spec.vcpu < 1 {
        e.push(
            "spec.vcpu",
            format!("must be at least 1, got {}", spec.vcpu),
        );
    }
    if spec.memory_mib < crate::class::MIN_MEMORY_MIB {
        e.push(
            "spec.memoryMiB",
            format!(
                "must be at least {}, got {}",
                crate::class::MIN_MEMORY_MIB,
                spec.memory_mib
            ),
        );
    }
    if spec.disk_gib < 1 {
        e.push(
            "spec.diskGiB",
            format!("must be at least 1, got {}", spec.disk_gib),
        );
    }
    inherited(
        &mut e,
        &spec.tolerations,
        spec.probes.as_ref(),
        spec.restart_policy.as_ref(),
    );
    e.into_result()
}

/// Validates an ImpVMTemplate spec.
pub fn template(spec: &ImpVMTemplateSpec) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    non_empty(&mut e, "spec.classRef.name", &spec.class_ref.name);
    if let Some(image) = &spec.inherited.image {
        image_ref(&mut e, "spec.image", image);
    }
    if let Some(d) = &spec.inherited.expire_after {
        expire_after(&mut e, "spec.expireAfter", d);
    }
    inherited(
        &mut e,
        &spec.tolerations,
        spec.inherited.probes.as_ref(),
        spec.inherited.restart_policy.as_ref(),
    );
    e.into_result()
}

/// Validates an ImpNetwork spec: address arithmetic the schema pattern cannot do.
pub fn network(spec: &ImpNetworkSpec) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    let subnet = match parse_cidr(&spec.subnet) {
        Ok(c) => Some(c),
        Err(m) => {
            e.push("spec.subnet", m);
            None
        }
    };
    if let Some(net) = subnet {
        let prefix = net.prefix();
        if prefix > 30 {
            e.push(
                "spec.subnet",
                format!(
                    "must leave room for a gateway and a VM (prefix at most /30), got /{prefix}"
                ),
            );
        }
        network_gateway(&mut e, spec, &net);
        network_cilium_cidr(&mut e, spec, &net);
        network_groups(&mut e, spec, &net);
    }
    for (i, d) in spec.dns.iter().enumerate() {
        if d.parse::<Ipv4Addr>().is_err() {
            e.push(
                format!("spec.dns[{i}]"),
                format!("must be an IPv4 address, got {d:?}"),
            );
        }
    }
    for (i, c) in spec.egress.iter().flat_map(|e| &e.allow).enumerate() {
        if let Err(m) = parse_cidr(c) {
            e.push(format!("spec.egress.allow[{i}]"), m);
        }
    }
    if let Some(n) = &spec.nat
        && let Some(i) = &n.egress_interface
        && let Err(m) = interface_name(i)
    {
        e.push("spec.nat.egressInterface", m);
    }
    e.into_result()
}

/// The longest Linux interface name in bytes (`IFNAMSIZ` less its NUL).
pub const MAX_INTERFACE_NAME: usize = 15;

/// Checks that `name` is a Linux network interface name by the kernel's rules
/// (`dev_valid_name`: 1-15 bytes, not `.` or `..`, no `/`, `:` or whitespace) and, stricter than
/// the kernel, made only of ASCII letters, digits and `.` `_` `-`: such a name is also safe to
/// write into an nft script, a command line or a file name (a tenant's `"` or `;` would be
/// nftables syntax, `*` a wildcard over every interface, `\` an escape). The node checks the
/// same rule again before writing a name into its rules (`imp_net::names::check_interface`). The error says what is wrong and what is allowed; the caller adds the
/// field's path.
pub fn interface_name(name: &str) -> Result<(), String> {
    const ALLOWED: &str = "1-15 ASCII letters, digits and '.', '_', '-', not '.' or '..'";
    let why = if name.is_empty() {
        "is empty".to_owned()
    } else if name.len() > MAX_INTERFACE_NAME {
        format!(
            "is {} bytes long, more than the kernel's {MAX_INTERFACE_NAME}",
            name.len()
        )
    } else if name == "." || name == ".." {
        "is a directory name the kernel refuses".to_owned()
    } else if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        format!("holds {c:?}, which an interface name may not")
    } else {
        return Ok(());
    };
    Err(format!(
        "must be a Linux interface name ({ALLOWED}); {name:?} {why}"
    ))
}

/// `spec.gateway`, when given: an IPv4 address inside the subnet, neither its network nor
/// its broadcast address.
fn network_gateway(e: &mut ValidationErrors, spec: &ImpNetworkSpec, net: &Ipv4Cidr) {
    let Some(gw) = &spec.gateway else {
        return;
    };
    match gw.parse::<Ipv4Addr>() {
        Ok(g) if !net.contains(g) => e.push(
            "spec.gateway",
            format!("{gw} is outside spec.subnet {}", spec.subnet),
        ),
        Ok(g) if net.is_reserved(g) => e.push(
            "spec.gateway",
            format!(
                "{gw} is the network or broadcast address of {}",
                spec.subnet
            ),
        ),
        Ok(_) => {}
        Err(_) => e.push(
            "spec.gateway",
            format!("must be an IPv4 address, got {gw:?}"),
        ),
    }
}

/// `spec.ipam.cilium.cidr`, when given: a CIDR inside the subnet.
fn network_cilium_cidr(e: &mut ValidationErrors, spec: &ImpNetworkSpec, net: &Ipv4Cidr) {
    let Some(cidr) = spec
        .ipam
        .as_ref()
        .and_then(|i| i.cilium.as_ref())
        .and_then(|c| c.cidr.as_ref())
    else {
        return;
    };
    match parse_cidr(cidr) {
        Ok(inner) if !net.covers(&inner) => e.push(
            "spec.ipam.cilium.cidr",
            format!("{cidr} must lie inside spec.subnet {}", spec.subnet),
        ),
        Ok(_) => {}
        Err(m) => e.push("spec.ipam.cilium.cidr", m),
    }
}

/// `spec.groups`: unique DNS-label names, at least one member each, and blocks
/// ([`group_block`]) that fit in the subnet together.
fn network_groups(e: &mut ValidationErrors, spec: &ImpNetworkSpec, net: &Ipv4Cidr) {
    let mut needed: u64 = 0;
    let mut names = BTreeSet::new();
    for (i, g) in spec.groups.iter().enumerate() {
        let path = format!("spec.groups[{i}]");
        dns_label(e, &format!("{path}.name"), &g.name);
        if !names.insert(g.name.as_str()) {
            e.push(
                format!("{path}.name"),
                format!("duplicate group name {:?}", g.name),
            );
        }
        if g.expected_size < 1 {
            e.push(
                format!("{path}.expectedSize"),
                format!("must be at least 1, got {}", g.expected_size),
            );
        }
        needed += group_block(g.expected_size.max(1));
    }
    let available = net.size();
    if needed > available {
        e.push(
            "spec.groups",
            format!(
                "need {needed} addresses but spec.subnet {} has {available}",
                spec.subnet
            ),
        );
    }
}

/// Addresses a group of `expected` members takes: the smallest power of two holding them plus
/// network and broadcast, at least 4 (a /30).
pub fn group_block(expected: i32) -> u64 {
    let want = u64::try_from(expected).unwrap_or(0) + 2;
    want.next_power_of_two().max(4)
}

/// The namespace of the VM that a snapshot or migration in namespace `namespace` acts on,
/// given its `spec.sourceVMNamespace` (`value`): always `namespace`. An empty value means the
/// object's own namespace; any other value is refused, naming the field, so that no one who
/// may create an ImpVMSnapshot or ImpVMMigration in one namespace can reach a VM of another
/// (its memory, disk and Secrets). `what` names the object in the message ("snapshot",
/// "migration"). The Go CRD accepts any string here; imp keeps the field (so Go manifests,
/// which repeat their own namespace, apply unchanged) and refuses the rest.
pub fn source_vm_namespace<'a>(
    what: &str,
    value: &str,
    namespace: &'a str,
) -> Result<&'a str, FieldError> {
    if value.is_empty() || value == namespace {
        return Ok(namespace);
    }
    Err(FieldError {
        path: "spec.sourceVMNamespace".to_owned(),
        message: format!(
            "must be the {what}'s own namespace {namespace:?} (or empty), got {value:?}"
        ),
    })
}

/// Validates an ImpVMSnapshot spec of an object in `namespace`.
pub fn snapshot(spec: &ImpVMSnapshotSpec, namespace: &str) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    dns_subdomain(&mut e, "spec.sourceVMName", &spec.source_vm_name);
    if let Err(f) = source_vm_namespace("snapshot", &spec.source_vm_namespace, namespace) {
        e.0.push(f);
    }
    if !(1..=10).contains(&spec.retention) {
        e.push(
            "spec.retention",
            format!("must be between 1 and 10, got {}", spec.retention),
        );
    }
    if let Some(s) = &spec.schedule
        && let Err(m) = cron(s)
    {
        e.push("spec.schedule", m);
    }
    match spec.storage.type_ {
        StorageType::OciRegistry => match &spec.storage.oci_registry {
            None => e.push(
                "spec.storage.ociRegistry",
                "is required when spec.storage.type is oci-registry",
            ),
            Some(r) => {
                image_ref(&mut e, "spec.storage.ociRegistry.repository", &r.repository);
                if let Some(s) = r.pull_secret_ref.as_ref().filter(|s| !s.name.is_empty()) {
                    let path = "spec.storage.ociRegistry.pullSecretRef.name";
                    dns_subdomain(&mut e, path, &s.name);
                }
            }
        },
        StorageType::NodeLocal => {
            if let Some(p) = &spec.storage.node_local
                && (!p.path.starts_with('/') || p.path.split('/').any(|c| c == ".."))
            {
                e.push(
                    "spec.storage.nodeLocal.path",
                    format!("must be an absolute path without '..', got {:?}", p.path),
                );
            }
        }
    }
    e.into_result()
}

/// What a snapshot's `spec.storage` cannot do once created: change (the node agent removes
/// the files where it wrote them, and a new place would leave them behind or point a removal
/// elsewhere). The CRD holds the same rule in CEL, for an API server without the webhook.
pub const STORAGE_IMMUTABLE: &str =
    "cannot change after creation; create a new ImpVMSnapshot for another storage";

/// Validates an update of an ImpVMSnapshot in `namespace`: the rules of [`snapshot`] plus a
/// `spec.storage` that stays as created.
pub fn snapshot_update(
    old: &ImpVMSnapshotSpec,
    new: &ImpVMSnapshotSpec,
    namespace: &str,
) -> Result<(), ValidationErrors> {
    let mut e = snapshot(new, namespace).err().unwrap_or_default();
    if old.storage != new.storage {
        e.push("spec.storage", STORAGE_IMMUTABLE);
    }
    e.into_result()
}

/// Validates an ImpVMMigration spec of an object in `namespace`.
pub fn migration(spec: &ImpVMMigrationSpec, namespace: &str) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    dns_subdomain(&mut e, "spec.sourceVMName", &spec.source_vm_name);
    if let Err(f) = source_vm_namespace("migration", &spec.source_vm_namespace, namespace) {
        e.0.push(f);
    }
    if let Some(n) = &spec.target_node {
        dns_subdomain(&mut e, "spec.targetNode", n);
    }
    e.into_result()
}

/// Validates a ClusterImpConfig, including its singleton name.
pub fn cluster_config(cfg: &ClusterImpConfig) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    let name = cfg.metadata.name.as_deref().unwrap_or("");
    if name != crate::cluster::CLUSTER_CONFIG_NAME {
        e.push(
            "metadata.name",
            format!("ClusterImpConfig is a singleton and must be named cluster, got {name:?}"),
        );
    }
    if let Some(c) = &cfg.spec.capacity {
        fraction(&mut e, "spec.capacity.defaultFraction", &c.default_fraction);
    }
    if let Some(p) = cfg
        .spec
        .observability
        .as_ref()
        .and_then(|o| o.metrics.as_ref())
    {
        range(
            &mut e,
            "spec.observability.metrics.port",
            Some(p.port),
            1,
            65535,
        );
    }
    let tracing = cfg
        .spec
        .observability
        .as_ref()
        .and_then(|o| o.tracing.as_ref());
    if tracing.is_some_and(|t| t.enabled && t.endpoint.is_empty()) {
        e.push(
            "spec.observability.tracing.endpoint",
            "must be set when tracing is enabled: http://host[:port][/path] of an OTLP/HTTP \
             collector (usually port 4318)",
        );
    }
    e.into_result()
}

/// Validates a ClusterImpNodeProfile spec.
pub fn node_profile(spec: &ClusterImpNodeProfileSpec) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    if let Some(f) = &spec.capacity_fraction {
        fraction(&mut e, "spec.capacityFraction", f);
    }
    range(&mut e, "spec.maxImpVMs", spec.max_imp_vms, 0, i32::MAX);
    range(&mut e, "spec.vcpuCapacity", spec.vcpu_capacity, 0, i32::MAX);
    if spec.memory_mib.is_some_and(|m| m < 0) {
        e.push("spec.memoryMiB", "must be at least 0");
    }
    if spec.vcpu_capacity.is_some_and(|v| v > 0) && spec.memory_mib.unwrap_or(0) == 0 {
        e.push(
            "spec.memoryMiB",
            "must be set when spec.vcpuCapacity is, or no VM can ever fit",
        );
    }
    e.into_result()
}

/// Fields a VM inherits from its class or template, checked the same way wherever they stand.
fn inherited(
    e: &mut ValidationErrors,
    ts: &[Toleration],
    p: Option<&ProbeSpec>,
    r: Option<&RestartPolicy>,
) {
    tolerations(e, "spec.tolerations", ts);
    if let Some(p) = p {
        probes(e, "spec.probes", p);
    }
    if let Some(r) = r {
        restart_policy(e, "spec.restartPolicy", r);
    }
}

fn non_empty(e: &mut ValidationErrors, path: &str, v: &str) {
    if v.is_empty() {
        e.push(path, "must not be empty");
    }
}

fn range(e: &mut ValidationErrors, path: &str, v: Option<i32>, min: i32, max: i32) {
    if let Some(v) = v
        && (v < min || v > max)
    {
        let allowed = if max == i32::MAX {
            format!("at least {min}")
        } else {
            format!("between {min} and {max}")
        };
        e.push(path, format!("must be {allowed}, got {v}"));
    }
}

fn expire_after(e: &mut ValidationErrors, path: &str, d: &GoDuration) {
    match d.parse() {
        Ok(v) if v.is_zero() || v >= MIN_EXPIRE_AFTER => {}
        Ok(_) => e.push(path, format!("must be 0 or at least 60s, got {d}")),
        Err(err) => e.push(path, err.to_string()),
    }
}

fn fraction(e: &mut ValidationErrors, path: &str, f: &str) {
    match f.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) && !f.contains(['e', 'E']) => {}
        _ => e.push(
            path,
            format!("must be a decimal between 0 and 1 such as \"0.9\", got {f:?}"),
        ),
    }
}

fn probes(e: &mut ValidationErrors, path: &str, p: &ProbeSpec) {
    for (name, probe) in [
        ("startupProbe", &p.startup_probe),
        ("readinessProbe", &p.readiness_probe),
        ("livenessProbe", &p.liveness_probe),
    ] {
        if let Some(probe) = probe {
            one_probe(e, &format!("{path}.{name}"), probe);
        }
    }
    if let Some(h) = &p.http_check {
        range(e, &format!("{path}.httpCheck.port"), h.port, 1, 65535);
        range(
            e,
            &format!("{path}.httpCheck.intervalSeconds"),
            Some(h.interval_seconds),
            1,
            i32::MAX,
        );
        range(
            e,
            &format!("{path}.httpCheck.failureThreshold"),
            Some(h.failure_threshold),
            1,
            i32::MAX,
        );
        if !h.path.starts_with('/') {
            e.push(
                format!("{path}.httpCheck.path"),
                format!("must start with '/', got {:?}", h.path),
            );
        }
    }
}

fn one_probe(e: &mut ValidationErrors, path: &str, p: &Probe) {
    match (&p.exec, &p.http) {
        (Some(_), Some(_)) => e.push(path, "exactly one of exec or http may be set, got both"),
        (None, None) => e.push(path, "one of exec or http is required"),
        (Some(x), None) if x.command.is_empty() => e.push(
            format!("{path}.exec.command"),
            "must have at least one element",
        ),
        (None, Some(h)) => range(e, &format!("{path}.http.port"), Some(h.port), 1, 65535),
        _ => {}
    }
    range(
        e,
        &format!("{path}.initialDelaySeconds"),
        Some(p.initial_delay_seconds),
        0,
        i32::MAX,
    );
    range(
        e,
        &format!("{path}.periodSeconds"),
        Some(p.period_seconds),
        1,
        i32::MAX,
    );
    range(
        e,
        &format!("{path}.failureThreshold"),
        Some(p.failure_threshold),
        1,
        i32::MAX,
    );
}

fn restart_policy(e: &mut ValidationErrors, path: &str, r: &RestartPolicy) {
    if let Err(err) = r.cool_down_period.parse() {
        e.push(format!("{path}.coolDownPeriod"), err.to_string());
    }
    if let Some(b) = &r.backoff {
        range(
            e,
            &format!("{path}.backoff.maxRetries"),
            Some(b.max_retries),
            0,
            i32::MAX,
        );
        let initial = b
            .initial_delay
            .parse()
            .map_err(|err| e.push(format!("{path}.backoff.initialDelay"), err.to_string()));
        let max = b
            .max_delay
            .parse()
            .map_err(|err| e.push(format!("{path}.backoff.maxDelay"), err.to_string()));
        if let (Ok(i), Ok(m)) = (initial, max)
            && i > m
        {
            e.push(
                format!("{path}.backoff.initialDelay"),
                format!(
                    "must not exceed backoff.maxDelay ({}), got {}",
                    b.max_delay, b.initial_delay
                ),
            );
        }
    }
}

fn env(e: &mut ValidationErrors, path: &str, vars: &[EnvVar]) {
    for (i, v) in vars.iter().enumerate() {
        let ok = !v.name.is_empty()
            && !v.name.starts_with(|c: char| c.is_ascii_digit())
            && v.name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if !ok {
            e.push(
                format!("{path}[{i}].name"),
                format!(
                    "must be letters, digits, '_', '-' or '.', not starting with a digit, got {:?}",
                    v.name
                ),
            );
        }
        if v.value.is_some() && v.value_from.is_some() {
            e.push(
                format!("{path}[{i}]"),
                "value and valueFrom are mutually exclusive",
            );
        }
    }
}

/// The Secrets and ConfigMaps a VM names are Kubernetes names: the operator reads each by
/// name for the VM's node (`crate::inputs`), and a name such as `../other/secrets/x` must be
/// refused here as it is there. An empty name stays allowed, as Kubernetes' own
/// LocalObjectReference allows it (and the Go project's YAML has it): it names nothing.
fn object_names(e: &mut ValidationErrors, spec: &ImpVMSpec) {
    let dns_subdomain = |e: &mut ValidationErrors, path: &str, name: &str| {
        if !name.is_empty() {
            dns_subdomain(e, path, name);
        }
    };
    for (i, v) in spec.env.iter().enumerate() {
        let Some(from) = &v.value_from else { continue };
        if let Some(s) = &from.secret_key_ref {
            let path = format!("spec.env[{i}].valueFrom.secretKeyRef.name");
            dns_subdomain(e, &path, &s.name);
        }
        if let Some(c) = &from.config_map_key_ref {
            let path = format!("spec.env[{i}].valueFrom.configMapKeyRef.name");
            dns_subdomain(e, &path, &c.name);
        }
    }
    for (i, f) in spec.env_from.iter().enumerate() {
        if let Some(s) = &f.secret_ref {
            dns_subdomain(e, &format!("spec.envFrom[{i}].secretRef.name"), &s.name);
        }
        if let Some(c) = &f.config_map_ref {
            dns_subdomain(e, &format!("spec.envFrom[{i}].configMapRef.name"), &c.name);
        }
    }
    if let Some(c) = spec
        .user_data
        .as_ref()
        .and_then(|u| u.config_map_ref.as_ref())
    {
        dns_subdomain(e, "spec.userData.configMapRef.name", &c.name);
    }
    for (i, s) in spec.image_pull_secrets.iter().enumerate() {
        dns_subdomain(e, &format!("spec.imagePullSecrets[{i}].name"), &s.name);
    }
}

fn tolerations(e: &mut ValidationErrors, path: &str, ts: &[Toleration]) {
    for (i, t) in ts.iter().enumerate() {
        let op = t.operator.as_deref().unwrap_or("Equal");
        if !matches!(op, "Equal" | "Exists") {
            e.push(
                format!("{path}[{i}].operator"),
                format!("must be Equal or Exists, got {op:?}"),
            );
        }
        if op == "Exists" && t.value.as_deref().is_some_and(|v| !v.is_empty()) {
            e.push(
                format!("{path}[{i}].value"),
                "must be empty when operator is Exists",
            );
        }
        if op == "Equal" && t.key.as_deref().unwrap_or("").is_empty() {
            e.push(
                format!("{path}[{i}].key"),
                "is required when operator is Equal",
            );
        }
        if let Some(eff) = t.effect.as_deref()
            && !matches!(eff, "" | "NoSchedule" | "PreferNoSchedule" | "NoExecute")
        {
            e.push(
                format!("{path}[{i}].effect"),
                format!("must be NoSchedule, PreferNoSchedule or NoExecute, got {eff:?}"),
            );
        }
    }
}

fn image_ref(e: &mut ValidationErrors, path: &str, r: &str) {
    let bad = r.is_empty()
        || r.contains(char::is_whitespace)
        || r.starts_with(['/', ':', '@', '.', '-'])
        || r.ends_with([':', '@', '/'])
        || r.chars()
            .any(|c| c.is_ascii_uppercase() && !r.contains(['@', ':']));
    if bad {
        e.push(
            path,
            format!(
                "must be an OCI image reference such as docker.io/library/nginx:1.27, got {r:?}"
            ),
        );
    } else if let Some((_, digest)) = r.split_once('@') {
        let valid = digest.split_once(':').is_some_and(|(alg, hex)| {
            !alg.is_empty() && !hex.is_empty() && hex.chars().all(|c| c.is_ascii_hexdigit())
        });
        if !valid {
            e.push(
                path,
                format!("digest must look like sha256:<hex>, got {digest:?}"),
            );
        }
    }
}

fn dns_label(e: &mut ValidationErrors, path: &str, v: &str) {
    let ok = !v.is_empty()
        && v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !v.starts_with('-')
        && !v.ends_with('-');
    if !ok {
        e.push(path, format!("must be a DNS-1123 label (lowercase letters, digits and '-', at most 63), got {v:?}"));
    }
}

fn dns_subdomain(e: &mut ValidationErrors, path: &str, v: &str) {
    let ok = !v.is_empty()
        && v.len() <= 253
        && v.split('.').all(|l| {
            !l.is_empty()
                && l.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if !ok {
        e.push(
            path,
            format!(
                "must be a DNS-1123 subdomain (lowercase letters, digits, '-' and '.'), got {v:?}"
            ),
        );
    }
}

/// Parses `a.b.c.d/p` and requires it to be a network address (no host bits set).
pub fn parse_cidr(s: &str) -> Result<Ipv4Cidr, String> {
    s.parse().map_err(|e: crate::ipv4::CidrError| e.to_string())
}

/// Checks a five-field cron expression field by field (numbers, ranges, steps, lists, `*`,
/// month and weekday names).
pub fn cron(s: &str) -> Result<(), String> {
    let fields: Vec<&str> = s.split_whitespace().collect();
    if fields.len() != 5 {
        return Err(format!(
            "must be a cron expression with 5 fields (minute hour day-of-month month day-of-week), got {} in {s:?}",
            fields.len()
        ));
    }
    const NAMES: [(&str, u32, u32, &[&str]); 5] = [
        ("minute", 0, 59, &[]),
        ("hour", 0, 23, &[]),
        ("day-of-month", 1, 31, &[]),
        (
            "month",
            1,
            12,
            &[
                "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
            ],
        ),
        (
            "day-of-week",
            0,
            7,
            &["sun", "mon", "tue", "wed", "thu", "fri", "sat"],
        ),
    ];
    for (field, (name, lo, hi, names)) in fields.iter().zip(NAMES) {
        cron_field(field, lo, hi, names).map_err(|m| format!("{name} field {field:?}: {m}"))?;
    }
    Ok(())
}

fn cron_field(f: &str, lo: u32, hi: u32, names: &[&str]) -> Result<(), String> {
    let value = |v: &str| -> Result<u32, String> {
        if let Some(i) = names.iter().position(|n| n.eq_ignore_ascii_case(v)) {
            return Ok(lo + u32::try_from(i).unwrap_or(0));
        }
        let n: u32 = v.parse().map_err(|_| format!("{v:?} is not a number"))?;
        if n < lo || n > hi {
            return Err(format!("{n} is outside {lo}-{hi}"));
        }
        Ok(n)
    };
    for part in f.split(',') {
        let (base, step) = match part.split_once('/') {
            Some((b, s)) => (b, Some(s)),
            None => (part, None),
        };
        if let Some(s) = step {
            let n: u32 = s
                .parse()
                .map_err(|_| format!("step {s:?} is not a number"))?;
            if n == 0 {
                return Err("step must be at least 1".to_owned());
            }
        }
        if base == "*" {
            continue;
        }
        match base.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (value(a)?, value(b)?);
                if a > b {
                    return Err(format!("range {a}-{b} is backwards"));
                }
            }
            None => {
                value(base)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inherited::Inherited;
    use crate::pools::ImpVMRunnerPoolSpec;
    use crate::shared::{ClusterObjectRef, GuestAgentConfig, LocalObjectRef, VmDesiredState};

    fn vm_spec() -> ImpVMSpec {
        ImpVMSpec {
            class_ref: Some(ClusterObjectRef {
                name: "small".into(),
            }),
            inherited: Inherited {
                image: Some("docker.io/library/busybox:1.36".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn msg(r: Result<(), ValidationErrors>) -> String {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn a_warm_pool_claimant_names_its_own_namespaces_pool_and_nothing_its_member_booted_with() {
        use crate::vm::WarmPoolRef;
        let claimant = ImpVMSpec {
            template_ref: Some(LocalObjectRef { name: "py".into() }),
            warm_pool_ref: Some(WarmPoolRef {
                name: "py".into(),
                namespace: Some("ci".into()),
            }),
            ..Default::default()
        };
        assert_eq!(warm_claim("ci", &claimant), Ok(()));
        assert_eq!(
            warm_claim("ci", &ImpVMSpec::default()),
            Ok(()),
            "no claim, no rule"
        );
        // Another namespace's pool, a name that is a path, a class instead of the template.
        let hostile = ImpVMSpec {
            class_ref: Some(ClusterObjectRef { name: "big".into() }),
            template_ref: None,
            warm_pool_ref: Some(WarmPoolRef {
                name: "../prod/py".into(),
                namespace: Some("prod".into()),
            }),
            ..claimant.clone()
        };
        let m = msg(warm_claim("ci", &hostile));
        for want in [
            "spec.warmPoolRef.name: must be a DNS-1123 subdomain",
            r#"spec.warmPoolRef.namespace: a VM claims only from a pool of its own namespace "ci", got "prod""#,
            "spec.classRef: may not be set beside spec.warmPoolRef",
            "spec.templateRef: is required beside spec.warmPoolRef",
        ] {
            assert!(m.contains(want), "{want} in {m}");
        }
        // What the member has already booted with, each refused by name.
        let booted: ImpVMSpec = serde_json::from_value(serde_json::json!({
            "templateRef": {"name": "py"}, "warmPoolRef": {"name": "py"},
            "image": "busybox", "runnerLayer": "runner:1", "ciliumLayer": "cilium:1",
            "networkRef": {"name": "net"}, "networkGroup": "g", "snapshotRef": "s-1",
            "nodeName": "n1", "env": [{"name": "A", "value": "1"}],
            "envFrom": [{"secretRef": {"name": "s"}}],
            "userData": {"configMapRef": {"name": "u"}}, "guestAgent": {"enabled": false}
        }))
        .unwrap();
        let m = msg(warm_claim("ci", &booted));
        for field in [
            "spec.image",
            "spec.runnerLayer",
            "spec.ciliumLayer",
            "spec.networkRef",
            "spec.networkGroup",
            "spec.snapshotRef",
            "spec.nodeName",
            "spec.env:",
            "spec.envFrom",
            "spec.userData",
            "spec.guestAgent.enabled",
        ] {
            assert!(m.contains(field), "{field} in {m}");
        }
        assert_eq!(m.matches(CLAIM_BOOTED).count(), 11, "{m}");
    }

    #[test]
    fn a_clone_needs_the_guest_agent_and_probes_beside_its_absence_are_left_to_the_boot() {
        let probe: ProbeSpec = serde_json::from_value(serde_json::json!({
            "readinessProbe": {"exec": {"command": ["true"]}}
        }))
        .unwrap();
        let off = Some(GuestAgentConfig {
            enabled: Some(false),
        });
        let agentless_with_probes = ImpVMSpec {
            inherited: Inherited {
                probes: Some(probe),
                guest_agent: off,
                ..vm_spec().inherited
            },
            ..vm_spec()
        };
        assert_eq!(
            vm(&agentless_with_probes),
            Ok(()),
            "the Go project accepts it; the agent refuses it at boot"
        );
        let clone = ImpVMSpec {
            snapshot_ref: Some("snap".into()),
            inherited: Inherited {
                guest_agent: Some(GuestAgentConfig {
                    enabled: Some(false),
                }),
                ..vm_spec().inherited
            },
            ..vm_spec()
        };
        assert_eq!(
            msg(vm(&clone)),
            format!("spec.snapshotRef: {CLONE_NEEDS_AGENT}")
        );
    }

    #[test]
    fn vm_accepts_class_or_template() {
        assert_eq!(vm(&vm_spec()), Ok(()));
        let t = ImpVMSpec {
            template_ref: Some(LocalObjectRef { name: "t".into() }),
            ..Default::default()
        };
        assert_eq!(vm(&t), Ok(()));
    }

    #[test]
    fn runner_scaling_rules_bind_github_actions_only_as_in_go() {
        use crate::pools::{
            PlatformType, RunnerPlatform, RunnerScaling, ScalingMode, WebhookDetection,
        };
        let pool = |type_, secret: Option<&str>| ImpVMRunnerPoolSpec {
            template_name: "runner".into(),
            platform: RunnerPlatform {
                type_,
                credentials_secret: Some("token".into()),
                ..Default::default()
            },
            scaling: Some(RunnerScaling {
                mode: Some(ScalingMode::Webhook),
                min_idle: Some(5),
                max_concurrent: Some(200),
                scale_up_step: Some(1),
                cooldown_seconds: Some(30),
                webhook: Some(WebhookDetection {
                    enabled: true,
                    secret_ref: secret.map(str::to_owned),
                }),
                polling: None,
            }),
            ..Default::default()
        };
        // No scope, minIdle over maxConcurrent, no webhook secret: Go's CRD takes all three
        // from a gitlab or forgejo pool.
        for t in [PlatformType::Gitlab, PlatformType::Forgejo] {
            assert_eq!(runner_pool(&pool(t, None)), Ok(()));
        }
        let github = msg(runner_pool(&pool(PlatformType::GithubActions, Some(""))));
        assert!(
            github.contains("spec.scaling.webhook.secretRef: is required"),
            "{github}"
        );
        let mut fixed = pool(PlatformType::GithubActions, Some("hmac"));
        if let Some(s) = fixed.scaling.as_mut() {
            s.min_idle = Some(1);
        }
        assert_eq!(runner_pool(&fixed), Ok(()));
    }

    #[test]
    fn expire_after_zero_and_sixty_are_fine() {
        for ok in ["0", "0s", "60s", "1m", "2h"] {
            let s = ImpVMSpec {
                inherited: Inherited {
                    expire_after: Some(GoDuration(ok.into())),
                    ..vm_spec().inherited
                },
                ..vm_spec()
            };
            assert_eq!(vm(&s), Ok(()), "{ok}");
        }
        let s = ImpVMSpec {
            inherited: Inherited {
                expire_after: Some(GoDuration("59s".into())),
                ..vm_spec().inherited
            },
            ..vm_spec()
        };
        assert_eq!(
            msg(vm(&s)),
            "spec.expireAfter: must be 0 or at least 60s, got 59s"
        );
    }

    #[test]
    fn node_name_may_be_cleared_or_set_but_not_moved() {
        let on = |n: Option<&str>| ImpVMSpec {
            node_name: n.map(Into::into),
            ..vm_spec()
        };
        assert_eq!(
            vm_update(&on(Some("a")), &on(None)),
            Ok(()),
            "clearing is how controllers release a VM"
        );
        assert_eq!(vm_update(&on(None), &on(Some("a"))), Ok(()));
        // A move's commit: from its source to its target, once the target holds the files.
        let mut moving = crate::vm::VmMove {
            source: "a".into(),
            target: "b".into(),
            phase: crate::vm::MovePhase::Sent,
            ..Default::default()
        };
        assert_eq!(
            vm_update_moving(&on(Some("a")), &on(Some("b")), Some(&moving)),
            Ok(())
        );
        assert!(
            msg(vm_update_moving(
                &on(Some("a")),
                &on(Some("c")),
                Some(&moving)
            ))
            .contains("cannot move from a to c")
        );
        moving.phase = crate::vm::MovePhase::Transferring;
        assert!(
            msg(vm_update_moving(
                &on(Some("a")),
                &on(Some("b")),
                Some(&moving)
            ))
            .contains("cannot move from a to b")
        );
        assert_eq!(vm_update(&on(Some("a")), &on(Some("a"))), Ok(()));
        assert!(
            msg(vm_update(&on(Some("a")), &on(Some("b"))))
                .starts_with("spec.nodeName: cannot move from a to b")
        );
    }

    #[test]
    fn a_placed_vm_keeps_what_it_was_booked_with_but_may_roll_its_image() {
        let placed = ImpVMSpec {
            node_name: Some("n1".into()),
            ..vm_spec()
        };
        let mut other_class = placed.clone();
        other_class.class_ref = Some(crate::shared::ClusterObjectRef {
            name: "large".into(),
        });
        other_class.lifecycle = crate::shared::VmLifecycle::Persistent;
        let m = msg(vm_update(&placed, &other_class));
        assert!(
            m.contains("spec.classRef: cannot change while the VM is placed on node n1")
                && m.contains("spec.lifecycle: cannot change"),
            "{m}"
        );
        // A persistent VM may take another class or template: it is placed anew with it.
        let mut persistent = placed.clone();
        persistent.lifecycle = crate::shared::VmLifecycle::Persistent;
        assert_eq!(vm_update(&persistent, &other_class), Ok(()));
        let mut templated = persistent.clone();
        templated.class_ref = None;
        templated.template_ref = Some(crate::shared::LocalObjectRef { name: "web".into() });
        assert_eq!(vm_update(&persistent, &templated), Ok(()));
        // A clone is restored with its snapshot's size: its class stays.
        let mut clone = persistent.clone();
        clone.snapshot_ref = Some("snap".into());
        let mut clone_resized = other_class.clone();
        clone_resized.snapshot_ref = clone.snapshot_ref.clone();
        assert!(msg(vm_update(&clone, &clone_resized)).contains("spec.classRef: cannot change"));
        // Not placed yet: anything goes.
        let mut unplaced = placed.clone();
        unplaced.node_name = None;
        let mut changed = other_class.clone();
        changed.node_name = None;
        assert_eq!(vm_update(&unplaced, &changed), Ok(()));
        // The image rolls (the operator restarts the VM with it).
        let mut new_image = placed.clone();
        new_image.inherited.image = Some("registry.example/app:2".into());
        assert_eq!(vm_update(&placed, &new_image), Ok(()));
    }

    #[test]
    fn every_error_is_reported_not_just_the_first() {
        let s = ImpVMSpec {
            inherited: Inherited {
                image: Some(String::new()),
                ..vm_spec().inherited
            },
            idle_timeout: Some(GoDuration("1s".into())),
            ..vm_spec()
        };
        let e = vm(&s).unwrap_err();
        let paths: Vec<&str> = e.0.iter().map(|f| f.path.as_str()).collect();
        assert!(
            paths.contains(&"spec.image") && paths.contains(&"spec.idleTimeout"),
            "{paths:?}"
        );
    }

    #[test]
    fn the_secrets_and_config_maps_a_vm_names_are_kubernetes_names() {
        let mut s: ImpVMSpec = serde_json::from_value(serde_json::json!({
            "image": "example.com/app:1",
            "classRef": {"name": "small"},
            "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "db-token", "key": "k"}}},
                    {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "app.cfg", "key": "k"}}}],
            "envFrom": [{"secretRef": {"name": "more"}}],
            "userData": {"configMapRef": {"name": "init"}},
            "imagePullSecrets": [{"name": "regcred"}]
        }))
        .unwrap();
        assert!(vm(&s).is_ok(), "{}", msg(vm(&s)));
        let path = "../../imp-system/secrets/imp-webhook-tls";
        s.env[0]
            .value_from
            .as_mut()
            .unwrap()
            .secret_key_ref
            .as_mut()
            .unwrap()
            .name = path.into();
        s.env_from[0].secret_ref.as_mut().unwrap().name = "a;b".into();
        s.user_data
            .as_mut()
            .unwrap()
            .config_map_ref
            .as_mut()
            .unwrap()
            .name = "x\"y".into();
        s.image_pull_secrets[0].name = "Reg".into();
        let m = msg(vm(&s));
        for field in [
            "spec.env[0].valueFrom.secretKeyRef.name",
            "spec.envFrom[0].secretRef.name",
            "spec.userData.configMapRef.name",
            "spec.imagePullSecrets[0].name",
        ] {
            assert!(
                m.contains(&format!("{field}: must be a DNS-1123 subdomain")),
                "{field}: {m}"
            );
        }
        assert!(m.contains(path), "{m}");
        assert!(!m.contains("spec.env[1]"), "{m}");
    }

    #[test]
    fn env_and_tolerations_are_checked() {
        let mut s = vm_spec();
        s.env = vec![
            EnvVar {
                name: "1BAD".into(),
                ..Default::default()
            },
            EnvVar {
                name: "GOOD_1".into(),
                ..Default::default()
            },
        ];
        s.tolerations = vec![Toleration {
            operator: Some("Maybe".into()),
            ..Default::default()
        }];
        let m = msg(vm(&s));
        assert!(m.contains("spec.env[0].name: must be letters"), "{m}");
        assert!(!m.contains("spec.env[1]"), "{m}");
        assert!(
            m.contains("spec.tolerations[0].operator: must be Equal or Exists, got \"Maybe\""),
            "{m}"
        );
        s.env.remove(0);
        s.tolerations = vec![Toleration {
            operator: Some("Exists".into()),
            ..Default::default()
        }];
        assert_eq!(vm(&s), Ok(()));
    }

    #[test]
    fn image_references() {
        for ok in [
            "busybox",
            "docker.io/library/nginx:1.27",
            "127.0.0.1:5000/t/img@sha256:abcdef0123",
            "ghcr.io/a/b",
        ] {
            let s = ImpVMSpec {
                inherited: Inherited {
                    image: Some(ok.into()),
                    ..vm_spec().inherited
                },
                ..vm_spec()
            };
            assert_eq!(vm(&s), Ok(()), "{ok}");
        }
        for bad in [
            "has space",
            "/abs",
            "img@sha256:",
            "img@nohex:zz",
            "trailing:",
        ] {
            let s = ImpVMSpec {
                inherited: Inherited {
                    image: Some(bad.into()),
                    ..vm_spec().inherited
                },
                ..vm_spec()
            };
            assert!(msg(vm(&s)).starts_with("spec.image:"), "{bad}");
        }
    }

    #[test]
    fn scale_to_zero_without_idle_timeout_or_network_warns() {
        let mut s = ImpVMSpec {
            desired_state: VmDesiredState::ScaleToZero,
            ..vm_spec()
        };
        let w = vm_warnings(&s);
        assert!(
            w.len() == 2
                && w[0].starts_with("spec.idleTimeout")
                && w[1].starts_with("spec.networkRef"),
            "{w:?}"
        );
        s.idle_timeout = Some(crate::duration::GoDuration("1m".into()));
        s.network_ref = Some(LocalObjectRef { name: "net".into() });
        assert!(vm_warnings(&s).is_empty());
        assert!(vm_warnings(&vm_spec()).is_empty());
    }

    #[test]
    fn a_restore_warns_of_the_env_and_user_data_it_does_not_apply() {
        let mut s = ImpVMSpec {
            snapshot_ref: Some("snap-1".into()),
            ..vm_spec()
        };
        assert!(vm_warnings(&s).is_empty());
        s.env = vec![EnvVar {
            name: "A".into(),
            value: Some("1".into()),
            ..EnvVar::default()
        }];
        s.env_from = vec![Default::default()];
        s.user_data = Some(
            serde_json::from_value(serde_json::json!({"configMapRef": {"name": "u"}})).unwrap(),
        );
        let w = vm_warnings(&s);
        assert_eq!(
            w,
            [
                format!("spec.env {RESTORE_KEEPS_ITS_OWN}"),
                format!("spec.envFrom {RESTORE_KEEPS_ITS_OWN}"),
                format!("spec.userData {RESTORE_KEEPS_ITS_OWN}"),
            ]
        );
        // Booted, they are applied: no warning.
        s.snapshot_ref = None;
        assert!(vm_warnings(&s).is_empty());
    }

    #[test]
    fn cidrs_and_groups() {
        assert_eq!(
            parse_cidr("10.0.0.0/8").map(|c| (c.network(), c.prefix())),
            Ok((Ipv4Addr::new(10, 0, 0, 0), 8))
        );
        assert!(parse_cidr("10.0.0.0/33").is_err());
        assert!(parse_cidr("10.0.0.1/8").unwrap_err().contains("host bits"));
        assert_eq!(group_block(14), 16);
        assert_eq!(group_block(1), 4);
        assert_eq!(group_block(2), 4);
        assert_eq!(group_block(30), 32);
        let net = ImpNetworkSpec {
            subnet: "10.0.0.0/24".into(),
            gateway: Some("10.0.0.255".into()),
            ..Default::default()
        };
        assert!(msg(network(&net)).contains("broadcast"));
        let net = ImpNetworkSpec {
            subnet: "10.0.0.0/24".into(),
            dns: vec!["dns.google".into()],
            ..Default::default()
        };
        assert_eq!(
            msg(network(&net)),
            "spec.dns[0]: must be an IPv4 address, got \"dns.google\""
        );
        let net = ImpNetworkSpec {
            subnet: "10.0.0.0/24".into(),
            egress: Some(crate::network::EgressSpec {
                allow: vec!["10.96.0.0/12".into(), "10.96.0.1/12".into()],
            }),
            ..Default::default()
        };
        let m = msg(network(&net));
        assert!(
            m.starts_with("spec.egress.allow[1]: ") && m.contains("host bits"),
            "{m}"
        );
        assert_eq!(net.egress_allow().len(), 1);
    }

    fn snap(source_ns: &str) -> ImpVMSnapshotSpec {
        serde_json::from_value(serde_json::json!({
            "sourceVMName": "db", "sourceVMNamespace": source_ns,
            "storage": {"type": "node-local"}
        }))
        .unwrap()
    }

    #[test]
    fn a_snapshot_or_migration_names_only_a_vm_of_its_own_namespace() {
        assert_eq!(snapshot(&snap("a"), "a"), Ok(()));
        assert_eq!(snapshot(&snap(""), "a"), Ok(()), "empty means its own");
        assert_eq!(
            msg(snapshot(&snap("b"), "a")),
            "spec.sourceVMNamespace: must be the snapshot's own namespace \"a\" (or empty), got \"b\""
        );
        assert_eq!(source_vm_namespace("snapshot", "", "a"), Ok("a"));
        assert_eq!(source_vm_namespace("snapshot", "a", "a"), Ok("a"));
        assert!(source_vm_namespace("snapshot", "b", "a").is_err());
        let mig = |ns: &str| ImpVMMigrationSpec {
            source_vm_name: "db".into(),
            source_vm_namespace: ns.into(),
            target_node: Some("node-b".into()),
        };
        assert_eq!(migration(&mig("a"), "a"), Ok(()));
        assert_eq!(
            msg(migration(&mig("victim"), "evil")),
            "spec.sourceVMNamespace: must be the migration's own namespace \"evil\" (or empty), got \"victim\""
        );
    }

    #[test]
    fn a_snapshots_storage_stays_as_created() {
        let old = snap("a");
        let mut later = old.clone();
        later.retention = 5;
        assert_eq!(snapshot_update(&old, &later, "a"), Ok(()));
        let mut moved = old.clone();
        moved.storage.node_local = Some(crate::snapshot::NodeLocalStorage {
            path: "/etc".into(),
        });
        assert_eq!(
            msg(snapshot_update(&old, &moved, "a")),
            format!("spec.storage: {STORAGE_IMMUTABLE}")
        );
        let both = msg(snapshot_update(
            &old,
            &ImpVMSnapshotSpec {
                source_vm_namespace: "b".into(),
                ..moved
            },
            "a",
        ));
        assert!(
            both.contains("spec.sourceVMNamespace") && both.contains("spec.storage"),
            "{both}"
        );
    }

    #[test]
    fn interface_names_follow_the_kernel_and_carry_no_script_syntax() {
        for ok in [
            "eth0",
            "enp0s31f6",
            "br-lan",
            "eth0.100",
            "veth_1",
            "x",
            "abcdefghijklmno",
        ] {
            assert_eq!(interface_name(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("", "is empty"),
            ("abcdefghijklmnop", "16 bytes long"),
            (".", "directory name"),
            ("..", "directory name"),
            ("a/b", "'/'"),
            ("a:b", "':'"),
            ("a b", "' '"),
            ("a\tb", "'\\t'"),
            ("x\";accept;#", "'\"'"),
            ("eth*", "'*'"),
            ("a\\b", "'\\\\'"),
            ("veth@x", "'@'"),
            ("a+b", "'+'"),
            ("é", "'é'"),
        ] {
            let m = interface_name(bad).unwrap_err();
            assert!(
                m.starts_with("must be a Linux interface name (") && m.contains(why),
                "{bad:?}: {m}"
            );
        }
        let net = ImpNetworkSpec {
            subnet: "10.0.0.0/24".into(),
            nat: Some(crate::network::NatSpec {
                enabled: true,
                egress_interface: Some("x\";accept;#".into()),
            }),
            ..Default::default()
        };
        let m = msg(network(&net));
        assert!(
            m.starts_with("spec.nat.egressInterface: must be a Linux interface name")
                && m.contains("holds '\"'"),
            "{m}"
        );
    }

    #[test]
    fn cron_expressions() {
        for ok in [
            "* * * * *",
            "0 */6 * * *",
            "15,45 9-17 * jan-jun mon-fri",
            "0 0 1 1 7",
        ] {
            assert_eq!(cron(ok), Ok(()), "{ok}");
        }
        for bad in [
            "* * * *",
            "60 * * * *",
            "* * 0 * *",
            "*/0 * * * *",
            "5-1 * * * *",
            "* * * foo *",
        ] {
            assert!(cron(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fractions() {
        let mut e = ValidationErrors::default();
        for ok in ["0", "0.9", "1", "1.0"] {
            fraction(&mut e, "f", ok);
        }
        assert!(e.0.is_empty(), "{e}");
        for bad in ["1.1", "-0.1", "1e-1", "x"] {
            fraction(&mut e, "f", bad);
        }
        assert_eq!(e.0.len(), 4);
    }
}
