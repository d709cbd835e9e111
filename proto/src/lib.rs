//! `bigfleet.v1alpha1` wire types, generated at build time from
//! `proto/bigfleet/v1alpha1/capacity_provider.proto`.

#[allow(clippy::all, missing_docs)]
pub mod v1alpha1 {
    tonic::include_proto!("bigfleet.v1alpha1");

    /// Encoded `FileDescriptorSet`, served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(
        env!("OUT_DIR"),
        "/capacity_provider_descriptor.bin"
    ));
}

pub use v1alpha1::*;
