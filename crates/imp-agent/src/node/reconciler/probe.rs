//! A running VM's probes ([`crate::node::probes`]): started for its attempt with the probes
//! its booking resolved (VM, then template, then class), their verdicts written as the
//! `Started`, `Ready` and `Healthy` conditions, and a VM whose liveness or startup probe
//! failed stopped as failed (`ProbeFailed`), for its restart policy. A failing HTTP check
//! (`probes.httpCheck`) turns `Ready` False (`HealthCheckFailed`) until it passes again.

use super::*;
use crate::node::probes::{Target, Verdicts};

/// The probes VM `vm` runs with: its booking's (VM over template over class; the operator
/// books a VM on a network that has no HTTP check of its own with the cluster's
/// `defaultHttpCheck`). With the guest agent off only the HTTP check can run (nothing in the
/// guest could run the others).
pub(super) fn spec_of(vm: &ImpVM) -> Option<imp_api::shared::ProbeSpec> {
    let booked = vm.status.as_ref()?.booking.as_ref()?;
    let spec = &booked.spec;
    let mut probes = spec.inherited.probes.clone()?;
    if spec
        .inherited
        .guest_agent
        .as_ref()
        .is_some_and(|g| !g.is_enabled())
    {
        probes.startup_probe = None;
        probes.readiness_probe = None;
        probes.liveness_probe = None;
    }
    let checked = probes.http_check.as_ref().is_some_and(|c| c.enabled);
    let probed = probes.startup_probe.is_some()
        || probes.readiness_probe.is_some()
        || probes.liveness_probe.is_some();
    (probed || checked).then_some(probes)
}

/// Makes the probes of running VM `vm` (record `record`) run; returns why the VM must be
/// stopped, when a liveness or startup probe has failed.
pub(super) fn run(ctx: &Context, vm: &ImpVM, uid: &str, record: &VmRecord) -> Option<String> {
    let Some(spec) = spec_of(vm) else {
        ctx.probes.stop(uid);
        return None;
    };
    let attempt = record.owner.as_ref().map_or(0, |o| o.attempt);
    let target = Target {
        vsock: record.vsock.clone(),
        port: record.agent_port,
        address: vm
            .status
            .as_ref()
            .and_then(|s| s.ip.as_deref())
            .and_then(|ip| ip.parse().ok()),
        check_in_guest: vm.spec.desired_state == VmDesiredState::ScaleToZero,
    };
    let tx = ctx.reconcile_tx.get().cloned();
    let obj = ObjectRef::from_obj(vm);
    let changed: crate::node::probes::Changed = Arc::new(move |_uid: &str| {
        if let Some(tx) = &tx {
            // A full queue means a reconcile of this node's VMs is pending anyway.
            let _ = tx.try_send(obj.clone());
        }
    });
    ctx.probes
        .ensure(uid, attempt, &spec, target, changed)
        .failed
}

/// Stops VM `vm` as failed for `why` (its probe's verdict), with a Warning Event naming the
/// probe and what it saw; the next reconcile reports the end.
pub(super) async fn fail(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    record: &VmRecord,
    why: String,
) -> Result<Action, Error> {
    tracing::warn!(vm = %key(vm), node = %ctx.settings.node, why, "stopping the VM: a probe failed");
    ctx.event_of(
        vm,
        EventType::Warning,
        ConditionReason::ProbeFailed.as_str(),
        "Stop",
        format!("{why}; stopping the VM"),
    )
    .await;
    ctx.probes.stop(uid);
    ctx.shims
        .fail(record, ctx.settings.stop_grace, &why)
        .await
        .map_err(|e| Error::Local {
            doing: "stopping after a failed probe",
            vm: key(vm),
            source: Box::new(e),
        })?;
    Ok(Action::requeue(Duration::ZERO))
}

/// Writes `v`, the verdicts of VM `vm`'s probes `spec`, into `status`'s conditions: `Started`
/// (startup probe), `Ready` (readiness, once started; without a readiness probe the guest
/// agent's answer stands), `Healthy` (liveness).
pub(super) fn conditions(
    status: &mut ImpVMStatus,
    spec: &imp_api::shared::ProbeSpec,
    v: &Verdicts,
    generation: Option<i64>,
) {
    let mut set = |type_, ok: bool, reason, message: &str| {
        let s = if ok {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        };
        conditions::set(
            &mut status.conditions,
            type_,
            s,
            reason,
            message,
            generation,
            now(),
        );
    };
    let verdict = |ok: bool| {
        if ok {
            ConditionReason::ProbeSucceeded
        } else {
            ConditionReason::ProbeFailed
        }
    };
    match &v.started {
        Some(s) => set(ConditionType::Started, s.ok, verdict(s.ok), &s.message),
        None if v.starting => set(
            ConditionType::Started,
            false,
            ConditionReason::Waiting,
            "waiting for the startup probe to succeed",
        ),
        None => {}
    }
    if v.starting {
        set(
            ConditionType::Ready,
            false,
            ConditionReason::Waiting,
            "waiting for the startup probe to succeed",
        );
    } else if spec.readiness_probe.is_some() {
        match &v.ready {
            Some(r) => set(ConditionType::Ready, r.ok, verdict(r.ok), &r.message),
            None => set(
                ConditionType::Ready,
                false,
                ConditionReason::Waiting,
                "waiting for the readiness probe's first result",
            ),
        }
    }
    if let Some(h) = &v.healthy {
        set(ConditionType::Healthy, h.ok, verdict(h.ok), &h.message);
    }
    if let Some(c) = v.checked.as_ref().filter(|c| !c.ok) {
        set(
            ConditionType::Ready,
            false,
            ConditionReason::HealthCheckFailed,
            &c.message,
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::node::probes::Verdict;

    fn spec(readiness: bool) -> imp_api::shared::ProbeSpec {
        let probe = || serde_json::from_value(json!({"exec": {"command": ["true"]}})).unwrap();
        imp_api::shared::ProbeSpec {
            startup_probe: Some(probe()),
            readiness_probe: readiness.then(probe),
            liveness_probe: Some(probe()),
            http_check: None,
        }
    }

    fn find(s: &ImpVMStatus, t: ConditionType) -> Option<(String, String, String)> {
        conditions::find(&s.conditions, t)
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    }

    fn running() -> ImpVMStatus {
        let mut s = ImpVMStatus::default();
        conditions::set(
            &mut s.conditions,
            ConditionType::Ready,
            ConditionStatus::True,
            ConditionReason::Running,
            "the guest agent answers",
            Some(1),
            now(),
        );
        s
    }

    #[test]
    fn a_startup_probe_holds_readiness_back_until_it_passes() {
        let mut s = running();
        let v = Verdicts {
            starting: true,
            ..Verdicts::default()
        };
        conditions(&mut s, &spec(true), &v, Some(1));
        assert_eq!(find(&s, ConditionType::Started).unwrap().0, "False");
        let ready = find(&s, ConditionType::Ready).unwrap();
        assert_eq!((ready.0.as_str(), ready.1.as_str()), ("False", "Waiting"));
        assert!(find(&s, ConditionType::Healthy).is_none());
    }

    #[test]
    fn readiness_decides_ready_and_liveness_healthy() {
        let mut s = running();
        let ok = |m: &str| {
            Some(Verdict {
                ok: true,
                message: m.into(),
            })
        };
        let v = Verdicts {
            started: ok("started"),
            ready: Some(Verdict {
                ok: false,
                message: "[\"test\", \"-e\", \"/ready\"] exited with code 1".into(),
            }),
            healthy: ok("GET 127.0.0.1:80/: HTTP 200"),
            ..Verdicts::default()
        };
        conditions(&mut s, &spec(true), &v, Some(1));
        assert_eq!(
            find(&s, ConditionType::Started).unwrap().1,
            "ProbeSucceeded"
        );
        let ready = find(&s, ConditionType::Ready).unwrap();
        assert_eq!(
            (ready.0.as_str(), ready.1.as_str()),
            ("False", "ProbeFailed")
        );
        assert!(ready.2.contains("/ready"));
        assert_eq!(find(&s, ConditionType::Healthy).unwrap().0, "True");
    }

    #[test]
    fn without_a_readiness_probe_the_guest_agents_answer_stands() {
        let mut s = running();
        let v = Verdicts {
            started: Some(Verdict {
                ok: true,
                message: "ok".into(),
            }),
            ..Verdicts::default()
        };
        conditions(&mut s, &spec(false), &v, Some(1));
        let ready = find(&s, ConditionType::Ready).unwrap();
        assert_eq!((ready.0.as_str(), ready.1.as_str()), ("True", "Running"));
    }

    #[test]
    fn a_failing_http_check_holds_ready_false_whatever_else_passes() {
        let mut s = running();
        let v = Verdicts {
            started: Some(Verdict {
                ok: true,
                message: "ok".into(),
            }),
            checked: Some(Verdict {
                ok: false,
                message: "the httpCheck failed 3 times in a row (every 10 s): GET 10.0.0.2:80/healthz: HTTP 503".into(),
            }),
            ..Verdicts::default()
        };
        conditions(&mut s, &spec(false), &v, Some(1));
        let ready = find(&s, ConditionType::Ready).unwrap();
        assert_eq!(
            (ready.0.as_str(), ready.1.as_str()),
            ("False", "HealthCheckFailed")
        );
        assert!(ready.2.contains("HTTP 503"));
        // Passing again: the guest agent's answer stands.
        let mut s = running();
        let v = Verdicts {
            checked: Some(Verdict {
                ok: true,
                message: "GET 10.0.0.2:80/healthz: HTTP 200 in 3 ms".into(),
            }),
            ..Verdicts::default()
        };
        conditions(&mut s, &spec(false), &v, Some(1));
        assert_eq!(find(&s, ConditionType::Ready).unwrap().1, "Running");
    }

    #[test]
    fn the_http_check_alone_runs_without_the_guest_agent() {
        let mut vm = ImpVM::new("v", ImpVMSpec::default());
        let booked: ImpVMSpec = serde_json::from_value(json!({
            "guestAgent": {"enabled": false},
            "probes": {
                "livenessProbe": {"exec": {"command": ["true"]}},
                "httpCheck": {"enabled": true, "port": 80}
            }
        }))
        .unwrap();
        vm.status = Some(ImpVMStatus {
            booking: Some(imp_api::vm::Booking {
                spec: booked,
                ..Default::default()
            }),
            ..Default::default()
        });
        let p = spec_of(&vm).unwrap();
        assert!(p.liveness_probe.is_none() && p.http_check.is_some());
        // A disabled check and no probes: nothing to run.
        let booking = vm.status.as_mut().unwrap().booking.as_mut().unwrap();
        booking
            .spec
            .inherited
            .probes
            .as_mut()
            .unwrap()
            .http_check
            .as_mut()
            .unwrap()
            .enabled = false;
        assert_eq!(spec_of(&vm), None);
    }
}
