//! `bigfleet.v1alpha1` wire types, generated at build time from
//! `proto/bigfleet/v1alpha1/capacity_provider.proto`.

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

pub use v1alpha1::*;
