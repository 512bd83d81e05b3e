//! The rules of the pool kinds and of a warm pool's claimant: ImpWarmPool, ImpVMRunnerPool
//! (with the github-actions scaling rules of the Go CRD), and an ImpVM naming
//! `spec.warmPoolRef`.

use super::{ValidationErrors, dns_subdomain, expire_after, image_ref, non_empty, range};
use crate::pools::{
    ImpVMRunnerPoolSpec, ImpWarmPoolSpec, PlatformType, RunnerScaling, ScalingMode,
};
use crate::vm::ImpVMSpec;

/// The rules of a claimant (`spec.warmPoolRef`) in namespace `namespace`: the pool of its own
/// namespace, beside a template and no class, and none of the fields a running member has
/// already booted with (its image and layers, its network, its environment and user data, a
/// snapshot, a node). Which template the pool names is checked against the pool itself.
pub fn warm_claim(namespace: &str, spec: &ImpVMSpec) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    let Some(pool) = &spec.warm_pool_ref else {
        return Ok(());
    };
    dns_subdomain(&mut e, "spec.warmPoolRef.name", &pool.name);
    if let Some(other) = pool.namespace.as_deref().filter(|n| *n != namespace) {
        e.push(
            "spec.warmPoolRef.namespace",
            format!(
                "a VM claims only from a pool of its own namespace {namespace:?}, got {other:?}"
            ),
        );
    }
    if spec.class_ref.is_some() {
        e.push("spec.classRef", CLAIM_CLASS);
    }
    if spec.template_ref.is_none() {
        e.push("spec.templateRef", "is required beside spec.warmPoolRef: the pool's template, which its members booted from");
    }
    let booted = [
        ("spec.image", spec.inherited.image.is_some()),
        ("spec.runnerLayer", spec.inherited.runner_layer.is_some()),
        ("spec.ciliumLayer", spec.inherited.cilium_layer.is_some()),
        ("spec.networkRef", spec.network_ref.is_some()),
        ("spec.networkGroup", spec.inherited.network_group.is_some()),
        ("spec.snapshotRef", spec.snapshot_ref.is_some()),
        ("spec.nodeName", spec.node_name.is_some()),
        ("spec.env", !spec.env.is_empty()),
        ("spec.envFrom", !spec.env_from.is_empty()),
        ("spec.userData", spec.user_data.is_some()),
        (
            "spec.guestAgent.enabled",
            spec.inherited
                .guest_agent
                .as_ref()
                .is_some_and(|a| !a.is_enabled()),
        ),
    ];
    for (field, _) in booted.iter().filter(|(_, set)| *set) {
        e.push(*field, CLAIM_BOOTED);
    }
    e.into_result()
}

/// A claimant naming a class.
pub const CLAIM_CLASS: &str = "may not be set beside spec.warmPoolRef: a claimed member runs with its pool's template's class";
/// A claimant setting what its member has already booted with.
pub const CLAIM_BOOTED: &str = "may not be set beside spec.warmPoolRef: the member a claim takes has already booted with its pool's template (its image, network, environment and user data) and takes only the claimant's name; create the VM without spec.warmPoolRef to boot with it";

/// Validates an ImpWarmPool spec.
pub fn warm_pool(spec: &ImpWarmPoolSpec) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    non_empty(&mut e, "spec.snapshotRef", &spec.snapshot_ref);
    non_empty(&mut e, "spec.templateName", &spec.template_name);
    if spec.size < 0 {
        e.push(
            "spec.size",
            format!("must be at least 0, got {}", spec.size),
        );
    }
    if let Some(d) = &spec.expire_after {
        expire_after(&mut e, "spec.expireAfter", d);
    }
    e.into_result()
}

/// Validates an ImpVMRunnerPool spec, including the github-actions scaling rules.
pub fn runner_pool(spec: &ImpVMRunnerPoolSpec) -> Result<(), ValidationErrors> {
    let mut e = ValidationErrors::default();
    non_empty(&mut e, "spec.templateName", &spec.template_name);
    runner_scope(&mut e, spec);
    if let Some(url) = &spec.platform.server_url
        && !(url.starts_with("https://") || url.starts_with("http://"))
    {
        e.push(
            "spec.platform.serverURL",
            format!("must be an http(s) URL, got {url:?}"),
        );
    }
    let github = spec.platform.type_ == PlatformType::GithubActions;
    match &spec.scaling {
        None if github => e.push("spec.scaling", "is required for github-actions"),
        None => {}
        Some(s) => {
            if github {
                github_scaling_set(&mut e, s);
            }
            scaling_ranges(&mut e, s);
            if github {
                github_scaling_rules(&mut e, s);
            }
            if let Some(p) = &s.polling {
                range(
                    &mut e,
                    "spec.scaling.polling.intervalSeconds",
                    Some(p.interval_seconds),
                    10,
                    i32::MAX,
                );
            }
        }
    }
    if let Some(l) = &spec.runner_layer {
        image_ref(&mut e, "spec.runnerLayer", l);
    }
    if let Some(d) = &spec.expire_after {
        expire_after(&mut e, "spec.expireAfter", d);
    }
    e.into_result()
}

/// `spec.platform.scope`: optional, as in the Go project; when given it names exactly one of
/// org or repo, and a repo is owner/name except on GitLab.
fn runner_scope(e: &mut ValidationErrors, spec: &ImpVMRunnerPoolSpec) {
    let (org, repo) = spec
        .platform
        .scope
        .as_ref()
        .map_or((None, None), |s| (s.org.as_ref(), s.repo.as_ref()));
    match (org, repo) {
        (Some(_), Some(_)) => e.push(
            "spec.platform.scope",
            "exactly one of org or repo may be set, got both",
        ),
        (None, None) if spec.platform.scope.is_some() => {
            e.push("spec.platform.scope", "one of org or repo is required")
        }
        (None, None) => {}
        (Some(o), None) => non_empty(e, "spec.platform.scope.org", o),
        (None, Some(r)) => {
            non_empty(e, "spec.platform.scope.repo", r);
            if spec.platform.type_ != PlatformType::Gitlab && !r.contains('/') {
                e.push(
                    "spec.platform.scope.repo",
                    format!("must be owner/name, got {r:?}"),
                );
            }
        }
    }
}

/// A github-actions pool sets its scaling mode and every scaling number explicitly.
fn github_scaling_set(e: &mut ValidationErrors, s: &RunnerScaling) {
    if s.mode.is_none() {
        e.push(
            "spec.scaling.mode",
            "is required for github-actions (webhook, polling or hybrid)",
        );
    }
    for (name, v) in [
        ("minIdle", s.min_idle),
        ("maxConcurrent", s.max_concurrent),
        ("scaleUpStep", s.scale_up_step),
        ("cooldownSeconds", s.cooldown_seconds),
    ] {
        if v.is_none() {
            e.push(
                format!("spec.scaling.{name}"),
                "must be set explicitly for github-actions",
            );
        }
    }
}

/// The lower bounds of the scaling numbers that are set, for every platform.
fn scaling_ranges(e: &mut ValidationErrors, s: &RunnerScaling) {
    range(e, "spec.scaling.minIdle", s.min_idle, 0, i32::MAX);
    range(
        e,
        "spec.scaling.maxConcurrent",
        s.max_concurrent,
        1,
        i32::MAX,
    );
    range(e, "spec.scaling.scaleUpStep", s.scale_up_step, 1, i32::MAX);
    range(
        e,
        "spec.scaling.cooldownSeconds",
        s.cooldown_seconds,
        10,
        i32::MAX,
    );
}

/// The cross-field scaling rules, which bind github-actions pools only, as in the Go CRD:
/// minIdle at most maxConcurrent, and the polling or webhook settings the mode needs.
fn github_scaling_rules(e: &mut ValidationErrors, s: &RunnerScaling) {
    if let (Some(min), Some(max)) = (s.min_idle, s.max_concurrent)
        && min > max
    {
        e.push(
            "spec.scaling.minIdle",
            format!("must not exceed spec.scaling.maxConcurrent ({max}), got {min}"),
        );
    }
    if matches!(s.mode, Some(ScalingMode::Polling | ScalingMode::Hybrid)) && s.polling.is_none() {
        e.push(
            "spec.scaling.polling",
            "is required for polling and hybrid modes",
        );
    }
    if matches!(s.mode, Some(ScalingMode::Webhook | ScalingMode::Hybrid))
        && s.webhook
            .as_ref()
            .and_then(|w| w.secret_ref.as_deref())
            .is_none_or(str::is_empty)
    {
        e.push(
            "spec.scaling.webhook.secretRef",
            "is required for webhook and hybrid modes",
        );
    }
}
