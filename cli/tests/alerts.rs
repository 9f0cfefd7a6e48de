//! The example alert rules in `deploy/` parse, cover the documented alerts, and only use
//! metrics that Postal records (promtool is not installable here; this is the check).

use std::collections::BTreeSet;

fn source_files(dir: &std::path::Path, out: &mut String) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            source_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

#[test]
fn alert_rules_parse_and_use_real_metrics() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("deploy/prometheus-alerts.yml")).unwrap();
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("valid YAML");
    let rules = doc["groups"][0]["rules"].as_sequence().expect("rules");
    let names: BTreeSet<&str> = rules.iter().map(|r| r["alert"].as_str().unwrap()).collect();
    for wanted in [
        "PostalOutboxBacklogHigh",
        "PostalPublishErrorRate",
        "PostalEventsParked",
        "PostalSlowProcessing",
        "PostalConsumerSlow",
        "PostalRelayStuck",
        "PostalHorizonStalled",
        "PostalDeadLetters",
        "PostalHistoryMaintenanceFailing",
        "PostalRelayAbsent",
        "PostalPartitionsUnowned",
        "PostalRelayChecksFailing",
        "PostalBatchesGivenUp",
        "PostalBatchRecordFailures",
        "PostalReplicationSlotHoldsHorizon",
        "PostalConsumerLagHigh",
        "PostalDeadLettersUnpublished",
    ] {
        assert!(names.contains(wanted), "missing alert {wanted}");
    }
    let mut code = String::new();
    for dir in ["producer/src", "consumer/src"] {
        source_files(&root.join(dir), &mut code);
    }
    for rule in rules {
        let expr = rule["expr"].as_str().expect("expr");
        assert!(rule["annotations"]["summary"].as_str().is_some());
        for metric in expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("postal_"))
        {
            let base = metric.trim_end_matches("_bucket");
            assert!(
                code.contains(&format!("\"{base}\"")),
                "alert {} uses {metric}, which Postal does not record",
                rule["alert"].as_str().unwrap()
            );
        }
    }
}
