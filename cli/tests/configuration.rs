//! README's configuration table and the variables Postal reads cannot drift apart.

use std::collections::BTreeMap;

use postal_shared::env::{Reader, VARIABLES};

fn reader(r: Reader) -> &'static str {
    match r {
        Reader::Relay => "relay",
        Reader::Consumer => "consumer",
        Reader::Both => "relay, consumer",
        Reader::Cli => "every `postal` command",
        Reader::Dashboard => "`postal dashboard`",
        _ => "?",
    }
}

fn sources(dir: &std::path::Path, out: &mut String) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs")
            && !path.ends_with("shared/src/env.rs")
        {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

/// Guarantee: README's configuration table lists exactly the variables of
/// `postal_shared::env::VARIABLES`, with who reads each and its default, and each of them is
/// read by Postal's code (a variable added, renamed or dropped in one place fails here).
#[test]
fn readme_table_lists_every_variable_postal_reads() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = readme
        .split("\n## Configuration\n")
        .nth(1)
        .expect("README has a Configuration section");
    let section = section.split("\n## ").next().unwrap();
    let mut rows = BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let name = cells[0].trim_matches('`').to_owned();
        let default = cells[2].trim_matches('`').to_owned();
        assert!(
            rows.insert(name.clone(), (cells[1].to_owned(), default))
                .is_none(),
            "{name} is listed twice"
        );
    }
    let mut code = String::new();
    for dir in [
        "producer/src",
        "consumer/src",
        "cli/src",
        "shared/src",
        "ops/src",
    ] {
        sources(&root.join(dir), &mut code);
    }
    for v in VARIABLES {
        let (read_by, default) = rows
            .remove(v.name)
            .unwrap_or_else(|| panic!("{} is missing from README's configuration table", v.name));
        assert_eq!(read_by, reader(v.reader), "{}: read by", v.name);
        assert_eq!(default, v.default, "{}: default", v.name);
        assert!(
            code.contains(&format!("\"{}\"", v.name)),
            "{} is listed but no code reads it",
            v.name
        );
    }
    assert!(
        rows.is_empty(),
        "README lists variables Postal does not read: {:?}",
        rows.keys()
    );
}

/// README's configuration table: variable → default, as written.
fn readme_defaults() -> BTreeMap<String, String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = readme.split("\n## Configuration\n").nth(1).unwrap();
    let section = section.split("\n## ").next().unwrap();
    section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            (
                cells[0].trim_matches('`').to_owned(),
                cells[2].trim_matches('`').to_owned(),
            )
        })
        .collect()
}

/// `postal <path> --help`, run with an empty environment (clap shows a set variable's value
/// in place of nothing).
fn help(path: &[String]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_postal"))
        .args(path)
        .arg("--help")
        .env_clear()
        .output()
        .unwrap();
    assert!(out.status.success(), "postal {path:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// Every command path (`relay`, `failed show`, …): the `Commands:` lists of `--help`, walked.
fn commands(path: Vec<String>, out: &mut Vec<Vec<String>>) {
    let text = help(&path);
    let mut subs = Vec::new();
    if let Some(list) = text.split("\nCommands:\n").nth(1) {
        for line in list.lines().take_while(|l| !l.trim().is_empty()) {
            let name = line.split_whitespace().next().unwrap();
            if name != "help" {
                subs.push(name.to_owned());
            }
        }
    }
    if subs.is_empty() {
        out.push(path);
        return;
    }
    for s in subs {
        let mut p = path.clone();
        p.push(s);
        commands(p, out);
    }
}

/// The variables a `--help` names, each with the default it shows (`None`: none).
fn help_defaults(text: &str) -> Vec<(String, Option<String>)> {
    let mut found = Vec::new();
    for piece in text.split("[env: ").skip(1) {
        let name: String = piece
            .chars()
            .take_while(|c| *c != '=' && *c != ']')
            .collect();
        let rest = piece[piece.find(']').unwrap() + 1..].trim_start();
        let default = rest
            .strip_prefix("[default: ")
            .map(|d| d[..d.find(']').unwrap()].to_owned());
        found.push((name, default));
    }
    found
}

/// Guarantee: every default `postal <command> --help` shows for a variable is the default
/// README's configuration table gives it (the relay's, for a variable whose consumer default
/// differs), and a variable README gives no value by default (`-`, `false`, `off`, `all`, …)
/// shows none: `--help` cannot promise a broker or a replication factor the documentation does
/// not. (Failed before: `relay`, `consumer reset` and `dead-letters replay` showed
/// `[default: 127.0.0.1:9092]` for `KAFKA_BOOTSTRAP_SERVERS`, whose README default is `-`.)
#[test]
fn every_help_default_is_readmes() {
    let readme = readme_defaults();
    let mut paths = Vec::new();
    commands(Vec::new(), &mut paths);
    assert!(
        paths.len() >= 15 && paths.iter().any(|p| p == &["relay"]),
        "{paths:?}"
    );
    let mut checked = 0;
    let mut problems = Vec::new();
    for path in &paths {
        for (name, shown) in help_defaults(&help(path)) {
            let Some(documented) = readme.get(&name) else {
                problems.push(format!(
                    "postal {}: {name} is not in README's table",
                    path.join(" ")
                ));
                continue;
            };
            let documented = documented.split(" (consumer: ").next().unwrap();
            let ok = match &shown {
                Some(s) => s == documented,
                None => ["-", "false", "off", "all", "all but *.dlq"].contains(&documented),
            };
            if !ok {
                problems.push(format!(
                    "postal {} --help: {name} default {shown:?}, README {documented:?}",
                    path.join(" ")
                ));
            }
            checked += 1;
        }
    }
    assert!(checked > 40, "only {checked} variables found in --help");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
