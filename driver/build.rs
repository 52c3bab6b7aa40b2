//! Generates the CSI v1 messages and services from `proto/csi.proto` with protox (no protoc).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    // The generator's settings live here: a change to them must regenerate too.
    println!("cargo:rerun-if-changed=build.rs");
    let fds = protox::compile(["csi.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Unimplemented for what a service leaves out: the resizer endpoint offers three calls.
        .generate_default_stubs(true)
        .compile_fds(fds)?;
    Ok(())
}
