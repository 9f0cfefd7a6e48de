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
