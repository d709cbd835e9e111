//! Compiles the .protos with protox (pure Rust), so no system `protoc` is needed.
//!
//! Two views are generated from the one file: the plain messages and the
//! client (`v1alpha1`), and the server (`serving`), in which `Machine` and
//! `MachineList` are pre-encoded bytes so the provider can answer Get and
//! List by copying what it already holds instead of building message trees.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "bigfleet/v1alpha1/capacity_provider.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("capacity_provider_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds.clone())?;
    let serving = out.join("serving");
    std::fs::create_dir_all(&serving)?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .out_dir(&serving)
        .extern_path(".bigfleet.v1alpha1.Machine", "crate::raw::EncodedMachine")
        .extern_path(
            ".bigfleet.v1alpha1.MachineList",
            "crate::raw::EncodedMachineList",
        )
        .compile_fds(fds)?;

    // The provider's own admin service: one view, client and server.
    let admin = "bigfleet/proxmox/admin/v1/admin.proto";
    println!("cargo:rerun-if-changed={admin}");
    let admin_fds = protox::compile([admin], ["."])?;
    std::fs::write(
        out.join("admin_descriptor.bin"),
        prost::Message::encode_to_vec(&admin_fds),
    )?;
    let admin_out = out.join("admin");
    std::fs::create_dir_all(&admin_out)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(&admin_out)
        .compile_fds(admin_fds)?;
    Ok(())
}
