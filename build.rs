//! Builds the gRPC examples' protobuf code (examples/proto/ledger.proto) with the protoc of
//! `protoc-bin-vendored`, so no system protobuf compiler is needed. Only this examples crate
//! does; the library crates have no protobuf build step.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure().compile_with_config(
        config,
        &["examples/proto/ledger.proto"],
        &["examples/proto"],
    )?;
    println!("cargo:rerun-if-changed=examples/proto/ledger.proto");
    Ok(())
}
