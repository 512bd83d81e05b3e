//! Starting a VM: its booked spec and class, environment, user data, pull credentials and
//! network resolved from the API, then its spec written and its shim spawned; or why it
//! cannot start yet.

use kube::runtime::reflector::ObjectRef;

use super::*;

/// The spec and class a VM boots with: exactly what the operator booked when it placed it
/// (`status.booking`), never a second lookup of its class or template, which may have been
/// edited or deleted since; or why it cannot start yet (not booked: the operator writes the
/// booking with the placement, or right after a user pins a VM to this node).
pub(super) fn booked(
    vm: &ImpVM,
) -> Result<(ImpVMSpec, imp_api::class::ImpVMClassSpec), &'static str> {
    let b = vm
        .status
        .as_ref()
        .and_then(|s| s.booking.as_ref())
        .ok_or("waiting for the operator's booking")?;
    Ok((b.spec.clone(), b.class.clone()))
}

/// The workload's environment from the Secrets and ConfigMaps `env` and `envFrom` name, as
/// the gateway handed them (`given`).
fn environment(
    spec: &ImpVMSpec,
    given: &imp_api::inputs::Inputs,
) -> Result<Vec<imp_proto::message::EnvVar>, String> {
    let secrets = given.secrets.iter().map(|(name, data)| {
        let text = data
            .iter()
            .map(|(k, v)| (k.clone(), String::from_utf8_lossy(&v.0).into_owned()));
        (name.clone(), text.collect())
    });
    let config_maps = given
        .config_maps
        .iter()
        .map(|(name, m)| (name.clone(), m.data.clone()));
    let sources = env::Sources {
        secrets: secrets.collect(),
        config_maps: config_maps.collect(),
    };
    env::resolve(spec, &sources)
}

/// The VM's user data from the ConfigMap `spec.userData.configMapRef` names (read at every
/// start, so an edit takes effect at the next one); none without user data.
fn user_data(
    spec: &ImpVMSpec,
    given: &imp_api::inputs::Inputs,
) -> Result<Option<imp_proto::config::UserData>, String> {
    let Some(name) = crate::node::userdata::config_map(spec) else {
        return Ok(None);
    };
    crate::node::userdata::from_config_map(name, given.config_maps.get(name)).map(Some)
}

/// Merges the `.dockerconfigjson` of the VM's pull secrets into one credentials file.
fn pull_credentials(
    ns: &str,
    spec: &ImpVMSpec,
    given: &imp_api::inputs::Inputs,
) -> Result<Option<Value>, String> {
    if spec.image_pull_secrets.is_empty() {
        return Ok(None);
    }
    let mut auths = serde_json::Map::new();
    for s in &spec.image_pull_secrets {
        let secret = given
            .secrets
            .get(&s.name)
            .ok_or_else(|| format!("pull secret {ns}/{}: Secret does not exist", s.name))?;
        let data = secret
            .get(".dockerconfigjson")
            .ok_or_else(|| format!("pull secret {ns}/{} has no .dockerconfigjson", s.name))?;
        let parsed: Value = serde_json::from_slice(&data.0)
            .map_err(|e| format!("pull secret {ns}/{}: .dockerconfigjson: {e}", s.name))?;
        if let Some(Value::Object(a)) = parsed.get("auths") {
            for (k, v) in a {
                auths.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
    }
    Ok(Some(json!({ "auths": auths })))
}

/// Says on the VM why it cannot start yet (phase unchanged), once per distinct message.
async fn not_startable(
    ctx: &Context,
    vm: &ImpVM,
    reason: ConditionReason,
    message: String,
) -> Result<Action, Error> {
    let mut status = vm.status.clone().unwrap_or_default();
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::False,
        reason,
        &message,
        vm.meta().generation,
        now(),
    );
    ctx.patch_status(vm, &status).await?;
    let uid = vm.uid().unwrap_or_default();
    let first = {
        let mut announced = ctx
            .announced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        announced.insert(uid, message.clone()).as_deref() != Some(message.as_str())
    };
    if first {
        tracing::warn!(vm = %key(vm), node = %ctx.settings.node, %reason, %message, "cannot start the VM");
        ctx.event(vm, EventType::Warning, reason.as_str(), message)
            .await;
        ctx.metrics.failure(reason.as_str());
    }
    Ok(Action::requeue(Duration::from_secs(30)))
}

use crate::node::snapshots::Stored;

/// The snapshot directory on this node a VM with `spec.snapshotRef` boots from, or why it
/// cannot (the operator placed it here because the files are here).
async fn snapshot_source(
    ctx: &Context,
    vm: &ImpVM,
    spec: &ImpVMSpec,
) -> Result<Option<std::path::PathBuf>, String> {
    let Some(name) = &spec.snapshot_ref else {
        return Ok(None);
    };
    let ns = vm.namespace().unwrap_or_default();
    let api: Api<imp_api::snapshot::ImpVMSnapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let exec = api
        .get_opt(name)
        .await
        .map_err(|e| format!("reading spec.snapshotRef {ns}/{name}: {e}"))?
        .ok_or_else(|| format!("spec.snapshotRef: ImpVMSnapshot {ns}/{name} not found"))?;
    let stored =
        crate::node::snapshots::source_on(&exec, &ctx.settings.node, &ctx.settings.snapshot_roots)
            .map_err(|why| format!("spec.snapshotRef {ns}/{name}: {why}"))?;
    match stored {
        Stored::Here(dir) => {
            // Read only through directories no link leads out of, and no one else may change.
            let place = crate::snapshot::place::recorded(
                &dir.to_string_lossy(),
                &ns,
                name,
                &ctx.settings.snapshot_roots,
            )
            .map_err(|why| format!("spec.snapshotRef {ns}/{name}: {why}"))?;
            tokio::task::spawn_blocking(move || crate::snapshot::place::open(&place))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| imp_api::chain::chain(&e)))
                .map(Some)
                .map_err(|why| format!("spec.snapshotRef {ns}/{name}: {why}"))
        }
        Stored::Registry(reference) => {
            // Pulled once per execution into the node's cache; a directory with its
            // snapshot.json is complete (a pull writes it last).
            let dir = crate::node::snapshots::cache_dir(
                &ctx.settings.state,
                &exec.uid().unwrap_or_default(),
            );
            if dir.join(crate::snapshot::MANIFEST).is_file() {
                return Ok(Some(dir));
            }
            let auth = crate::node::snapshots::registry_auth(&ctx.client, &exec, &reference)
                .await
                .map_err(|why| format!("spec.snapshotRef {ns}/{name}: {why}"))?;
            let pulled = crate::snapshot::oci::pull(&reference, &dir, &auth)
                .await
                .map_err(|e| format!("spec.snapshotRef {ns}/{name}: pulling {reference}: {e}"))?;
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, reference, bytes = pulled.bytes_downloaded, "snapshot pulled");
            Ok(Some(dir))
        }
    }
}

/// What a start reads besides the VM's booking: each can refuse the start, with its reason.
struct Inputs {
    env: Vec<imp_proto::message::EnvVar>,
    user_data: Option<imp_proto::config::UserData>,
    from_snapshot: Option<std::path::PathBuf>,
    credentials: Option<Value>,
}

/// Reads the VM's environment, user data, snapshot source and pull credentials.
async fn inputs(
    ctx: &Context,
    vm: &ImpVM,
    spec: &ImpVMSpec,
) -> Result<Inputs, (ConditionReason, String)> {
    let invalid = |why| (ConditionReason::InvalidSpec, why);
    let refs = imp_api::inputs::of_vm(spec);
    let given = crate::node::inputs::of_vm(&ctx.client, vm, &refs)
        .await
        .map_err(|e| (ConditionReason::Waiting, imp_api::chain::chain(&e)))?;
    let ns = vm.namespace().unwrap_or_default();
    Ok(Inputs {
        env: environment(spec, &given).map_err(invalid)?,
        user_data: user_data(spec, &given).map_err(invalid)?,
        from_snapshot: snapshot_source(ctx, vm, spec).await.map_err(invalid)?,
        credentials: pull_credentials(&ns, spec, &given)
            .map_err(|why| (ConditionReason::ImagePullFailed, why))?,
    })
}

/// How soon a VM whose Secrets and ConfigMaps the gateway could not hand out asks again.
const INPUTS_RETRY: Duration = Duration::from_secs(2);

/// Starts the VM's shim and records phase `Starting`.
pub(super) async fn start(ctx: &Context, vm: &ImpVM, uid: &str) -> Result<Action, Error> {
    // A descriptor kept from a VMM whose suspend never ended (the VM stopped meanwhile) would
    // hold the TAP the new VMM opens by name.
    if let Some(scale) = &ctx.scale {
        scale.drop_kept(uid).await;
    }
    let (spec, class) = match booked(vm) {
        Ok(r) => r,
        // The booking's write raises a watch event that reconciles the VM again; the requeue
        // only covers an operator that is down.
        Err(why) => {
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, why, "not starting yet");
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
    };
    let runtime = boot::runtime_for(&class, &ctx.caps);
    if let Some(problem) = ctx.caps.problem(runtime) {
        return not_startable(ctx, vm, ConditionReason::RuntimeStartFailed, problem).await;
    }
    let inputs = match inputs(ctx, vm, &spec).await {
        Ok(i) => i,
        // The gateway is not reachable (an operator starting, an upgrade): said on the VM,
        // and asked again soon rather than after a refusal's pause.
        Err((reason @ ConditionReason::Waiting, why)) => {
            not_startable(ctx, vm, reason, why).await?;
            return Ok(Action::requeue(INPUTS_RETRY));
        }
        Err((reason, why)) => return not_startable(ctx, vm, reason, why).await,
    };
    let network = match wire(ctx, vm, uid, &spec).await {
        Ok(n) => n,
        Err(NotWired::Waiting(why)) => {
            tracing::info!(vm = %key(vm), node = %ctx.settings.node, why, "not starting yet");
            return Ok(Action::requeue(Duration::from_secs(2)));
        }
        Err(NotWired::Refused(why)) => {
            return not_startable(ctx, vm, ConditionReason::NetworkSetupFailed, why).await;
        }
    };
    let from_snapshot = inputs.from_snapshot.clone();
    let pid = match launch(ctx, vm, uid, (&spec, &class), runtime, inputs, network).await? {
        Ok(pid) => pid,
        Err(invalid) => return end_invalid(ctx, vm, invalid).await,
    };
    tracing::info!(vm = %key(vm), node = %ctx.settings.node, shim = pid, runtime = runtime.as_str(), image = spec.inherited.image.as_deref().unwrap_or(""), "starting");
    report_starting(ctx, vm, &spec, runtime, from_snapshot.as_deref()).await
}

/// Builds the VM's spec for its shim from its booking and `inputs`, and starts the shim; its
/// pid, or (inner error) why the booking can never boot. The network is unwired if the
/// start fails.
async fn launch(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    (spec, class): (&ImpVMSpec, &imp_api::class::ImpVMClassSpec),
    runtime: imp_api::shared::VmRuntime,
    inputs: Inputs,
    network: Option<imp_net::NetAttachment>,
) -> Result<Result<u32, String>, Error> {
    let auth_file = inputs
        .credentials
        .as_ref()
        .map(|_| auth_file(&ctx.settings.state, uid));
    let owner = Owner {
        namespace: vm.namespace().unwrap_or_default(),
        name: vm.name_any(),
        uid: uid.to_owned(),
        attempt: observed(vm).attempt,
        revision: observed(vm).revision,
    };
    let choices = boot::Choices {
        runtime,
        env: inputs.env,
        auth_file: auth_file.clone(),
    };
    let mut vm_spec = match boot::vm_spec(owner, spec, class, choices, &ctx.settings.boot) {
        Ok(s) => s,
        Err(e) => {
            ctx.unwire(uid).await;
            return Ok(Err(e.0));
        }
    };
    vm_spec.network = network;
    vm_spec.from_snapshot = inputs.from_snapshot;
    vm_spec.user_data = inputs.user_data;
    let private = auth_file
        .zip(inputs.credentials)
        .map(|(path, creds)| PrivateFile {
            path,
            content: creds.to_string().into_bytes(),
        });
    match ctx.shims.start(uid, vm_spec, private).await {
        Ok(pid) => {
            ctx.follow(uid, pid, ObjectRef::from_obj(vm));
            Ok(Ok(pid))
        }
        Err(e) => {
            ctx.unwire(uid).await;
            Err(Error::Local {
                doing: "starting the shim of",
                vm: key(vm),
                source: Box::new(e),
            })
        }
    }
}

/// Records phase `Starting` (Ready False, saying what is booted how) and its Event.
async fn report_starting(
    ctx: &Context,
    vm: &ImpVM,
    spec: &ImpVMSpec,
    runtime: imp_api::shared::VmRuntime,
    from_snapshot: Option<&std::path::Path>,
) -> Result<Action, Error> {
    let mut status = vm.status.clone().unwrap_or_default();
    status.phase = Some(VmPhase::Starting);
    status.started_at = Some(now());
    status.running_at = None;
    status.finished_at = None;
    status.exit_code = None;
    status.runtime_pid = None;
    status.node_name = Some(ctx.settings.node.clone());
    status.runtime = Some(runtime.as_str().to_owned());
    let msg = match from_snapshot {
        Some(dir) => format!(
            "restoring snapshot {} ({}) under {}",
            spec.snapshot_ref.as_deref().unwrap_or(""),
            dir.display(),
            runtime.as_str()
        ),
        None => format!(
            "pulling {} and booting under {}",
            spec.inherited.image.as_deref().unwrap_or(""),
            runtime.as_str()
        ),
    };
    conditions::set(
        &mut status.conditions,
        ConditionType::Ready,
        ConditionStatus::False,
        ConditionReason::Starting,
        &msg,
        vm.meta().generation,
        now(),
    );
    ctx.patch_status(vm, &status).await?;
    ctx.event(
        vm,
        EventType::Normal,
        "Starting",
        format!("{msg} on node {}", ctx.settings.node),
    )
    .await;
    Ok(Action::requeue(Duration::from_secs(60)))
}

/// Wires the VM's network, or says why not (a VM with a networkRef on an agent without
/// networking waits, naming why).
pub(super) async fn wire(
    ctx: &Context,
    vm: &ImpVM,
    uid: &str,
    spec: &ImpVMSpec,
) -> Result<Option<imp_net::NetAttachment>, NotWired> {
    match &ctx.net {
        Some(net) => network::attach(&ctx.client, net, vm, uid, spec).await,
        None if spec.network_ref.is_some() => Err(NotWired::Refused(
            "this node's agent runs without networking (--no-network)".to_owned(),
        )),
        None => Ok(None),
    }
}

/// A VM that can never boot as specified: Failed with InvalidSpec.
async fn end_invalid(ctx: &Context, vm: &ImpVM, message: String) -> Result<Action, Error> {
    let report = Report::Ended {
        phase: VmPhase::Failed,
        exit_code: None,
        reason: ConditionReason::InvalidSpec,
        message,
    };
    write_report(ctx, vm, report, None).await?;
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use imp_api::inherited::Inherited;

    #[test]
    fn a_vm_boots_from_its_booking_and_waits_without_one() {
        let mut vm = ImpVM::new("v", ImpVMSpec::default());
        vm.spec.class_ref = Some(imp_api::shared::ClusterObjectRef {
            name: "resized-since".into(),
        });
        assert_eq!(
            booked(&vm).unwrap_err(),
            "waiting for the operator's booking"
        );
        let class = imp_api::class::ImpVMClassSpec {
            vcpu: 2,
            memory_mib: 384,
            disk_gib: 3,
            ..Default::default()
        };
        let spec = ImpVMSpec {
            inherited: Inherited {
                image: Some("booked:1".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        vm.status = Some(imp_api::vm::ImpVMStatus {
            booking: Some(imp_api::vm::Booking {
                class: class.clone(),
                spec: spec.clone(),
                revision: 0,
            }),
            ..Default::default()
        });
        assert_eq!(booked(&vm).unwrap(), (spec, class));
    }
}
