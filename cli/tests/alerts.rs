//! The example alert rules in `deploy/` parse, cover the documented alerts, and only use
//! metrics that Postal records, and every alert fires in its promtool unit test
//! (`deploy/prometheus-alerts.test.yml`, run through promtool where it is available).

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
        "PostalDeadLettersUnpublishable",
        "PostalConsumerTopicStopped",
        "PostalRelayClaimsWaiting",
        "PostalRelayTopicStuck",
        "PostalConsumerStalled",
        "PostalConsumerRecordsExpired",
        "PostalConsumerAbsent",
        "PostalWalSlotMissing",
        "PostalWalSlotStuck",
        "PostalWalSlotRetainedWalGrowing",
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

/// promtool: `POSTAL_PROMTOOL`, else `promtool` on PATH.
fn promtool() -> Option<std::path::PathBuf> {
    if let Some(p) = std::env::var_os("POSTAL_PROMTOOL") {
        return Some(p.into());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("promtool"))
            .find(|p| p.is_file())
    })
}

/// The rule's annotations as its alert with `labels` renders them (`{{ $labels.x }}`).
fn rendered(rule: &serde_yaml::Value, labels: &serde_yaml::Mapping) -> serde_yaml::Mapping {
    let mut out = serde_yaml::Mapping::new();
    if let Some(annotations) = rule["annotations"].as_mapping() {
        for (k, v) in annotations {
            let mut text = v.as_str().unwrap_or_default().to_owned();
            for (label, value) in labels {
                let (label, value) = (label.as_str().unwrap(), value.as_str().unwrap());
                text = text.replace(&format!("{{{{ $labels.{label} }}}}"), value);
            }
            out.insert(k.clone(), text.into());
        }
    }
    out
}

/// Guarantee: every alert of `deploy/prometheus-alerts.yml` has a unit test in
/// `deploy/prometheus-alerts.test.yml` where it fires (series set up as the condition the
/// alert is about) — checked always — and, where promtool is available, the rules pass
/// `promtool check rules` and every unit test passes `promtool test rules` (each firing case,
/// and the healthy series that raise nothing). The expected annotations are the rules' own,
/// rendered with the expected labels.
#[test]
fn every_alert_fires_in_its_promtool_unit_test() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let rules_text = std::fs::read_to_string(root.join("prometheus-alerts.yml")).unwrap();
    let rules: serde_yaml::Value = serde_yaml::from_str(&rules_text).unwrap();
    let rules = rules["groups"][0]["rules"].as_sequence().unwrap().clone();
    let text = std::fs::read_to_string(root.join("prometheus-alerts.test.yml")).unwrap();
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("valid YAML");
    let mut fired = BTreeSet::new();
    for test in doc["tests"].as_sequence_mut().expect("tests") {
        for case in test["alert_rule_test"].as_sequence_mut().unwrap() {
            let name = case["alertname"].as_str().unwrap().to_owned();
            let rule = rules
                .iter()
                .find(|r| r["alert"].as_str() == Some(name.as_str()))
                .unwrap_or_else(|| panic!("the unit tests name {name}, which is no alert"));
            for alert in case["exp_alerts"].as_sequence_mut().unwrap() {
                fired.insert(name.clone());
                let labels = alert["exp_labels"]
                    .as_mapping()
                    .cloned()
                    .unwrap_or_default();
                alert["exp_annotations"] = rendered(rule, &labels).into();
            }
        }
    }
    for rule in &rules {
        let name = rule["alert"].as_str().unwrap();
        assert!(
            fired.contains(name),
            "{name} never fires in prometheus-alerts.test.yml"
        );
    }
    let Some(promtool) = promtool() else {
        eprintln!("promtool not found (POSTAL_PROMTOOL or PATH): rules not run through promtool");
        return;
    };
    let dir = std::env::temp_dir().join(format!("postal-alerts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("prometheus-alerts.yml"), &rules_text).unwrap();
    std::fs::write(
        dir.join("prometheus-alerts.test.yml"),
        serde_yaml::to_string(&doc).unwrap(),
    )
    .unwrap();
    for args in [
        ["check", "rules", "prometheus-alerts.yml"],
        ["test", "rules", "prometheus-alerts.test.yml"],
    ] {
        let out = std::process::Command::new(&promtool)
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("promtool runs");
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
