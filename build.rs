//! Build script: with the `efa` feature, compiles the libfabric shim (`src/backend/efa/shim.c`)
//! against the system's libfabric, found with pkg-config. Without the feature it does nothing.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "efa")]
    efa();
}

#[cfg(feature = "efa")]
fn efa() {
    println!("cargo::rerun-if-changed=src/backend/efa/shim.c");
    let lib = match pkg_config::Config::new()
        .atleast_version("1.9")
        .probe("libfabric")
    {
        Ok(lib) => lib,
        Err(e) => panic!(
            "feature `efa` needs libfabric's development files (Debian/Ubuntu: \
             `apt-get install libfabric-dev pkg-config`): {e}"
        ),
    };
    let mut build = cc::Build::new();
    build.file("src/backend/efa/shim.c").warnings(true);
    for dir in &lib.include_paths {
        build.include(dir);
    }
    build.compile("actorpipe_fabric_shim");
    // pkg-config already printed the link lines for libfabric itself.
}
