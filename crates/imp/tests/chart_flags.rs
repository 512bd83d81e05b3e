//! The flags the Helm chart passes are flags this binary has: the containers' arguments of
//! `helm template charts/imp` (default values, and the toggles that change arguments) are given
//! to `imp` itself, which parses every one of them (names and values) before it answers the
//! `--help` put at their end. A flag renamed in the code, or misspelt in the chart, fails here
//! rather than in a crash-looping Pod.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::process::Command;

use serde_json::Value;

/// The chart, in the checkout.
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../charts/imp");

/// What the kubelet substitutes for `$(POD_NAMESPACE)`.
const NS: &str = "imp-system";

/// The arguments of every container of `helm template` with `set` (`--set` values).
fn container_args(helm: &std::path::Path, set: &[&str]) -> Vec<(String, Vec<String>)> {
    let home = std::env::temp_dir().join(format!("imp-chart-flags-{}", std::process::id()));
    let mut cmd = Command::new(helm);
    cmd.args(["template", "imp", CHART, "--namespace", NS])
        .args(["--api-versions", "cert-manager.io/v1"])
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    for s in set {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().unwrap();
    let _ = std::fs::remove_dir_all(&home);
    assert!(
        out.status.success(),
        "helm template {set:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut found = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let obj = <Value as serde::Deserialize>::deserialize(doc).unwrap();
        let containers = obj["spec"]["template"]["spec"]["containers"].as_array();
        for c in containers.into_iter().flatten() {
            let args = c["args"].as_array().unwrap().iter();
            let args = args.map(|a| a.as_str().unwrap().replace("$(POD_NAMESPACE)", NS));
            found.push((c["name"].as_str().unwrap().to_owned(), args.collect()));
        }
    }
    found
}

#[test]
fn every_flag_the_chart_passes_is_parsed_by_imp() {
    let helm = match imp_testenv::controlplane::helm() {
        Ok(h) => h,
        Err(e) => {
            imp_testenv::guard::require(false, &e.to_string());
            return;
        }
    };
    let toggles: [&[&str]; 3] = [
        &[],
        &[
            "webhook.certManager.enabled=true",
            "logJson=true",
            "agent.firecracker.allowUnjailed=true",
        ],
        &[
            "webhook.enabled=false",
            "agent.extraArgs={--no-network}",
            "agent.egressDeny={10.244.0.0/16,10.96.0.0/12}",
        ],
    ];
    let mut seen = 0;
    for set in toggles {
        for (container, args) in container_args(&helm, set) {
            let out = Command::new(env!("CARGO_BIN_EXE_imp"))
                .args(&args)
                .arg("--help")
                .env_remove("RUST_LOG")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "container {container} with {set:?}: `imp {}` is refused:\n{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
            seen += 1;
        }
    }
    assert_eq!(seen, 6, "the operator and the agent, three renderings each");
}
