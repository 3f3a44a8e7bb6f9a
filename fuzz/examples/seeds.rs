//! Writes the seed corpus: `cargo run --example seeds` (in fuzz/) puts each of
//! `crowdgrad_fuzz::seeds()` into `corpus/<target>/seed-<name>` next to this manifest.

fn main() -> std::io::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (target, name, bytes) in crowdgrad_fuzz::seeds() {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(format!("seed-{name}")), bytes)?;
    }
    println!("seeds written under {}", root.display());
    Ok(())
}
