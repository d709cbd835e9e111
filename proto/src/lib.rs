//! `bigfleet.v1alpha1` wire types, generated at build time from
//! `proto/bigfleet/v1alpha1/capacity_provider.proto`, and the provider's own
//! admin service from `proto/bigfleet/proxmox/admin/v1/admin.proto`.

pub mod raw;

/// Messages and the client.
#[allow(clippy::all, missing_docs)]
pub mod v1alpha1 {
    tonic::include_proto!("bigfleet.v1alpha1");

    /// Encoded `FileDescriptorSet`, served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(
        env!("OUT_DIR"),
        "/capacity_provider_descriptor.bin"
    ));
}

/// The server side: the same messages, except that `Machine` and
/// `MachineList` are [`raw::EncodedMachine`] / [`raw::EncodedMachineList`]
/// (bytes the server encoded itself). On the wire nothing differs.
#[allow(clippy::all, missing_docs)]
pub mod serving {
    include!(concat!(env!("OUT_DIR"), "/serving/bigfleet.v1alpha1.rs"));
}

/// `bigfleet.proxmox.admin.v1`: the provider's own day-2 service (Reclaim),
/// client and server. Not part of the BigFleet wire contract.
#[allow(clippy::all, missing_docs)]
pub mod admin {
    include!(concat!(
        env!("OUT_DIR"),
        "/admin/bigfleet.proxmox.admin.v1.rs"
    ));

    /// Encoded `FileDescriptorSet`, served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/admin_descriptor.bin"));
}

pub use v1alpha1::*;
