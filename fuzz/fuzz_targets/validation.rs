//! The admission rules the operator's webhook applies to every imp object: whatever JSON a
//! client sends, decoding and validating it ends with a decision (never a panic), and a
//! refusal names the fields it refuses.
#![no_main]

use imp_api::validation;
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;

fn check<T: DeserializeOwned>(
    json: &[u8],
    rule: impl Fn(&T) -> Result<(), validation::ValidationErrors>,
) {
    if let Ok(spec) = serde_json::from_slice::<T>(json)
        && let Err(errs) = rule(&spec)
    {
        assert!(!errs.0.is_empty(), "a refusal without a field");
        assert!(!errs.to_string().is_empty());
    }
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks the kind, the rest is its spec as JSON.
    let Some((&kind, json)) = data.split_first() else {
        return;
    };
    match kind % 10 {
        0 => check::<imp_api::ImpVMSpec>(json, |s| {
            let _ = validation::vm_warnings(s);
            validation::vm(s)
        }),
        1 => {
            // An update: the old spec and the new one, split at the first NUL.
            let (old, new) = match json.iter().position(|&b| b == 0) {
                Some(i) => (&json[..i], &json[i + 1..]),
                None => (json, json),
            };
            if let (Ok(old), Ok(new)) = (
                serde_json::from_slice::<imp_api::ImpVMSpec>(old),
                serde_json::from_slice::<imp_api::ImpVMSpec>(new),
            ) {
                let _ = validation::vm_update(&old, &new);
            }
        }
        2 => check::<imp_api::ImpVMClassSpec>(json, validation::class),
        3 => check::<imp_api::ImpVMTemplateSpec>(json, validation::template),
        4 => check::<imp_api::ImpNetworkSpec>(json, validation::network),
        5 => check::<imp_api::ImpVMSnapshotSpec>(json, |s| validation::snapshot(s, "ns")),
        6 => check::<imp_api::ImpWarmPoolSpec>(json, validation::warm_pool),
        7 => check::<imp_api::ImpVMRunnerPoolSpec>(json, validation::runner_pool),
        8 => check::<imp_api::ClusterImpConfig>(json, validation::cluster_config),
        _ => {
            if let Ok(s) = std::str::from_utf8(json) {
                let _ = validation::cron(s);
                let _ = validation::parse_cidr(s);
                let _ = validation::interface_name(s);
            }
            check::<imp_api::ClusterImpNodeProfileSpec>(json, validation::node_profile);
        }
    }
});
