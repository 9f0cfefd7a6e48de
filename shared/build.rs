//! Rebuild when a migration is added or changed (`sqlx::migrate!` embeds them at compile time).
//! `migrations` is a link to the workspace's `migrations/` (a packaged crate holds the files).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
