//! Compiles `proto/fanin/control/v1/control.proto` (at the workspace root) to
//! Rust with protox (a pure-Rust protobuf compiler) feeding tonic-prost-build,
//! so building needs no system `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest.join("../../proto");
    let file = proto_root.join("fanin/control/v1/control.proto");
    println!("cargo:rerun-if-changed={}", file.display());

    let fds = protox::compile([&file], [&proto_root])?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(fds)?;
    Ok(())
}
