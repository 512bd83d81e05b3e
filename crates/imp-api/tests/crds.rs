//! The committed CRDs (charts/imp/files/crds/imp.dev.yaml, which the chart's `templates/crds.yaml`
//! emits) are exactly what the types generate, each kept by `helm uninstall`, and each CRD
//! carries the names, scope, subresources and columns of the Go project's.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

use std::path::Path;

const COMMITTED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../charts/imp/files/crds/imp.dev.yaml"
);

#[test]
fn committed_crds_match_the_types() {
    let generated = imp_api::crd::yaml_stream().unwrap();
    let committed = std::fs::read_to_string(Path::new(COMMITTED)).unwrap_or_default();
    if std::env::var_os("IMP_UPDATE_CRDS").is_some() {
        std::fs::write(COMMITTED, &generated).unwrap();
        return;
    }
    assert!(
        committed == generated,
        "charts/imp/files/crds/imp.dev.yaml is stale: run \
         `cargo run -p imp -- crds > charts/imp/files/crds/imp.dev.yaml` \
         (or IMP_UPDATE_CRDS=1 cargo test -p imp-api --test crds) and commit it"
    );
}

#[test]
fn every_crd_is_kept_by_helm_uninstall() {
    for crd in imp_api::crd::all() {
        let annotations = crd.metadata.annotations.unwrap_or_default();
        assert_eq!(
            annotations
                .get("helm.sh/resource-policy")
                .map(String::as_str),
            Some("keep"),
            "{:?}",
            crd.metadata.name
        );
    }
}

/// kind, plural, short name, namespaced, status subresource, printer columns.
type Expected = (
    &'static str,
    &'static str,
    &'static str,
    bool,
    bool,
    &'static [&'static str],
);

#[test]
fn crd_names_scope_and_columns_match_the_go_project() {
    // kind, plural, short name, namespaced, status subresource, printer columns (beyond Age).
    let want: [Expected; 10] = [
        (
            "ImpVM",
            "impvms",
            "impvm",
            true,
            true,
            &["Phase", "Node", "IP", "Age"],
        ),
        (
            "ImpVMClass",
            "impvmclasses",
            "impcls",
            false,
            false,
            &["VCPU", "Memory", "Disk", "Arch"],
        ),
        (
            "ImpVMTemplate",
            "impvmtemplates",
            "impvmt",
            true,
            false,
            &["Class", "Network", "Age"],
        ),
        (
            "ImpNetwork",
            "impnetworks",
            "impnet",
            true,
            true,
            &["Subnet", "NAT", "Age"],
        ),
        (
            "ImpVMSnapshot",
            "impvmsnapshots",
            "impsnap",
            true,
            true,
            &["Source", "Phase", "Schedule", "Age"],
        ),
        (
            "ImpVMMigration",
            "impvmmigrations",
            "impmig",
            true,
            true,
            // Go's four, and how the move is made and how long the VM stopped (issue 40).
            &["Source", "Target", "Phase", "Mode", "Downtime", "Age"],
        ),
        (
            "ImpWarmPool",
            "impwarmpools",
            "impwp",
            true,
            true,
            // Go's four, the claims served and the base members restore from (issue 39:
            // `kubectl get impwp` shows them).
            &["Snapshot", "Size", "Ready", "Claimed", "Base", "Age"],
        ),
        (
            "ImpVMRunnerPool",
            "impvmrunnerpools",
            "imprp",
            true,
            true,
            &["Platform", "Template", "Idle", "Active", "Age"],
        ),
        (
            "ClusterImpConfig",
            "clusterimpconfigs",
            "impcfg",
            false,
            false,
            &["CNI", "DefaultFraction"],
        ),
        (
            "ClusterImpNodeProfile",
            "clusterimpnodeprofiles",
            "impnp",
            false,
            false,
            &["Fraction", "MaxVMs"],
        ),
    ];
    let crds = imp_api::crd::all();
    assert_eq!(crds.len(), want.len());
    for (crd, (kind, plural, short, namespaced, status, columns)) in crds.iter().zip(want) {
        let s = &crd.spec;
        assert_eq!(s.group, "imp.dev");
        assert_eq!(s.names.kind, kind);
        assert_eq!(s.names.plural, plural);
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some(format!("{plural}.imp.dev").as_str())
        );
        assert_eq!(
            s.names.short_names.as_deref(),
            Some(&[short.to_owned()][..]),
            "{kind}"
        );
        assert_eq!(
            s.names.categories.as_deref(),
            Some(&["imp".to_owned()][..]),
            "{kind}"
        );
        assert_eq!(
            s.scope,
            if namespaced { "Namespaced" } else { "Cluster" },
            "{kind}"
        );
        let v = &s.versions[0];
        assert_eq!(
            (v.name.as_str(), v.served, v.storage),
            ("v1alpha1", true, true)
        );
        let has_status = v
            .subresources
            .as_ref()
            .and_then(|r| r.status.as_ref())
            .is_some();
        assert_eq!(has_status, status, "{kind} status subresource");
        let cols: Vec<&str> = v
            .additional_printer_columns
            .iter()
            .flatten()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(cols, columns, "{kind} printer columns");
    }
}

#[test]
fn impvm_node_column_reads_status_node_name() {
    let crd = imp_api::crd::all().remove(0);
    let cols = crd.spec.versions[0]
        .additional_printer_columns
        .clone()
        .unwrap();
    let node = cols.iter().find(|c| c.name == "Node").unwrap();
    assert_eq!(node.json_path, ".status.nodeName");
}
