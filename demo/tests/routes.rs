//! The demo's two routes agree: `scripts/demo.sh` (the local stack) and `docker compose up demo`
//! (docker-compose.yml, demo/Dockerfile). No Docker engine is needed: these tests read the files.
//! They check that the compose file parses, sets only variables the demo and Postal read, and
//! publishes the stack's ports; that the Dockerfile builds with the script's `cargo build` and
//! copies exactly the programs `demo` starts; and that every variable of `scripts/stack.sh` is
//! documented with the stack in CONTRIBUTING.md.

use std::collections::BTreeSet;
use std::path::PathBuf;

fn repo_file(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn compose() -> serde_yaml::Value {
    serde_yaml::from_str(&repo_file("docker-compose.yml")).expect("docker-compose.yml parses")
}

/// `NAME: value` pairs of a service's `environment` map.
fn environment(compose: &serde_yaml::Value, service: &str) -> Vec<(String, String)> {
    let env = compose["services"][service]["environment"]
        .as_mapping()
        .unwrap_or_else(|| panic!("service {service} has an environment map"));
    env.iter()
        .map(|(k, v)| {
            let v = match v {
                serde_yaml::Value::String(s) => s.clone(),
                serde_yaml::Value::Number(n) => n.to_string(),
                other => panic!("{service}: {k:?} has a value that is not a string: {other:?}"),
            };
            (k.as_str().expect("variable name").to_owned(), v)
        })
        .collect()
}

/// The words of the `cargo build …` in `scripts/demo.sh` (`BUILD=(cargo build …)`).
fn script_build() -> Vec<String> {
    let script = repo_file("scripts/demo.sh");
    let line = script
        .lines()
        .find_map(|l| l.strip_prefix("BUILD=("))
        .expect("scripts/demo.sh has BUILD=(…)");
    line.trim_end_matches(')')
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// The Dockerfile's instructions, continuation lines joined.
fn dockerfile() -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in repo_file("demo/Dockerfile").lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && current.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                out.push(std::mem::take(&mut current));
            }
        }
    }
    out
}

#[test]
fn compose_demo_sets_only_variables_that_are_read() {
    let compose = compose();
    let demo = &compose["services"]["demo"];
    assert_eq!(
        demo["build"]["dockerfile"].as_str(),
        Some("demo/Dockerfile"),
        "the demo service builds demo/Dockerfile"
    );
    for dep in ["postgres", "kafka"] {
        assert_eq!(
            demo["depends_on"][dep]["condition"].as_str(),
            Some("service_healthy"),
            "the demo waits until {dep} is healthy"
        );
    }
    let postal: BTreeSet<&str> = postal_shared::env::VARIABLES
        .iter()
        .map(|v| v.name)
        .collect();
    let env = environment(&compose, "demo");
    let mut unknown = Vec::new();
    for (name, _) in &env {
        if !postal.contains(name.as_str()) && !postal_demo::DEMO_VARIABLES.contains(&name.as_str())
        {
            unknown.push(name.clone());
        }
    }
    assert!(
        unknown.is_empty(),
        "the compose file's demo service sets variables neither the demo nor Postal reads: {unknown:?}"
    );
    let names: Vec<&str> = env.iter().map(|(n, _)| n.as_str()).collect();
    for required in ["DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS"] {
        assert!(
            names.contains(&required),
            "the demo service sets {required}"
        );
    }
    // The broker advertises the in-network listener the demo connects to.
    let bootstrap = &env
        .iter()
        .find(|(n, _)| n == "KAFKA_BOOTSTRAP_SERVERS")
        .unwrap()
        .1;
    let advertised = environment(&compose, "kafka")
        .into_iter()
        .find(|(n, _)| n == "KAFKA_ADVERTISED_LISTENERS")
        .expect("kafka advertises its listeners")
        .1;
    assert!(
        advertised
            .split(',')
            .any(|l| l.split_once("://").map(|(_, a)| a) == Some(bootstrap.as_str())),
        "the demo's KAFKA_BOOTSTRAP_SERVERS={bootstrap} is not an advertised listener ({advertised})"
    );
}

#[test]
fn demo_variables_are_the_ones_demo_reads() {
    let source = repo_file("demo/src/bin/demo.rs");
    let mut read = BTreeSet::new();
    for (i, _) in source.match_indices("\"DEMO_") {
        let name: String = source[i + 1..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || *c == '_')
            .collect();
        read.insert(name);
    }
    let listed: BTreeSet<String> = postal_demo::DEMO_VARIABLES
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(read, listed, "DEMO_VARIABLES against demo.rs's reads");
}

#[test]
fn compose_publishes_the_stack_default_ports() {
    let stack = repo_file("scripts/stack.sh");
    let default_of = |var: &str| -> String {
        let key = format!("${{{var}:-");
        let at = stack
            .find(&key)
            .unwrap_or_else(|| panic!("{var} in stack.sh"))
            + key.len();
        stack[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect()
    };
    let compose = compose();
    for (service, var) in [
        ("postgres", "POSTAL_PG_PORT"),
        ("kafka", "POSTAL_KAFKA_PORT"),
    ] {
        let ports: Vec<&str> = compose["services"][service]["ports"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{service} publishes ports"))
            .iter()
            .filter_map(|p| p.as_str())
            .collect();
        let want = format!("127.0.0.1:{}:", default_of(var));
        assert!(
            ports.iter().any(|p| p.starts_with(&want)),
            "{service} publishes {ports:?}, not the stack's {var} default ({want}…)"
        );
    }
}

#[test]
fn dockerfile_builds_what_the_script_builds() {
    let build = script_build();
    assert_eq!(&build[..2], ["cargo", "build"], "{build:?}");
    let runs: Vec<Vec<String>> = dockerfile()
        .iter()
        .filter_map(|i| i.strip_prefix("RUN "))
        .filter(|r| r.contains("cargo "))
        .map(|r| r.split_whitespace().map(str::to_owned).collect())
        .collect();
    assert_eq!(
        runs,
        vec![build],
        "demo/Dockerfile's cargo command differs from scripts/demo.sh's BUILD"
    );
}

#[test]
fn dockerfile_copies_the_programs_demo_starts() {
    let copy = dockerfile()
        .into_iter()
        .find(|i| i.starts_with("COPY --from=build "))
        .expect("demo/Dockerfile copies the binaries from the build stage");
    let words: Vec<&str> = copy.split_whitespace().skip(2).collect();
    let (dest, sources) = words.split_last().expect("COPY sources and destination");
    let copied: BTreeSet<&str> = sources
        .iter()
        .map(|s| {
            s.strip_prefix("/src/target/debug/")
                .unwrap_or_else(|| panic!("{s} is not a debug binary (the script builds debug)"))
        })
        .collect();
    let mut wanted: BTreeSet<&str> = postal_demo::DEMO_PROGRAMS.into_iter().collect();
    wanted.insert("demo");
    assert_eq!(copied, wanted);
    // `demo` finds them next to itself, and the image runs it.
    assert_eq!(*dest, "/usr/local/bin/");
    assert!(
        dockerfile().iter().any(|i| i == r#"CMD ["demo"]"#),
        "the image runs demo"
    );
}

#[test]
fn stack_variables_are_documented_with_the_stack() {
    let stack = repo_file("scripts/stack.sh");
    let mut names = BTreeSet::new();
    for (i, _) in stack.match_indices("${POSTAL_") {
        let name: String = stack[i + 2..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || *c == '_')
            .collect();
        names.insert(name);
    }
    assert!(names.len() >= 15, "found {names:?}");
    let contributing = repo_file("CONTRIBUTING.md");
    let section = contributing
        .split("### The stack's settings")
        .nth(1)
        .expect("CONTRIBUTING.md has a section \"The stack's settings\"");
    let section = section.split("\n## ").next().unwrap();
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !section.contains(&format!("`{n}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "stack.sh variables not in CONTRIBUTING.md's \"The stack's settings\": {missing:?}"
    );
}
