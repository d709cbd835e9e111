//! The gRPC face of the engine: `bigfleet.v1alpha1.CapacityProvider`.

use std::sync::Arc;

use bigfleet_proto::raw::{EncodedMachine, EncodedMachineList};
use bigfleet_proto::serving as pb;
use bigfleet_proto::serving::capacity_provider_server::{CapacityProvider, CapacityProviderServer};
use tonic::{Request, Response, Status};

use crate::engine::{Ack, Engine};
use crate::fence::Token;

/// The message the serving binary logs once its gRPC listener accepts calls;
/// tools that boot a provider wait for it.
pub const STARTUP_MESSAGE: &str = "serving CapacityProvider";

/// Largest request the service decodes: room for the bootstrap blob cap
/// plus metadata; anything larger is refused by the transport.
pub const MAX_DECODING_MESSAGE_SIZE: usize = 4 * 1024 * 1024;

#[derive(Clone)]
pub struct CapacityService {
    engine: Arc<Engine>,
}

impl CapacityService {
    pub fn new(engine: Arc<Engine>) -> CapacityService {
        CapacityService { engine }
    }

    pub fn into_server(self) -> CapacityProviderServer<CapacityService> {
        CapacityProviderServer::new(self).max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE)
    }
}

fn ack(result: Result<Ack, crate::KitError>) -> Result<Response<pb::TransitionAck>, Status> {
    let ack = result?;
    Ok(Response::new(pb::TransitionAck {
        operation_id: ack.operation_id,
        machine: Some(ack.machine.encoded()),
    }))
}

#[tonic::async_trait]
impl CapacityProvider for CapacityService {
    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let r = request.into_inner();
        let token = Token::new(r.shard_id, r.shard_epoch, r.sequence_number);
        ack(self.engine.create(&r.machine_id, token).await)
    }

    async fn configure(
        &self,
        request: Request<pb::ConfigureRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let r = request.into_inner();
        let token = Token::new(r.shard_id, r.shard_epoch, r.sequence_number);
        ack(self
            .engine
            .configure(
                &r.machine_id,
                token,
                r.cluster_id,
                r.bootstrap_blob,
                r.shard_metadata,
            )
            .await)
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let r = request.into_inner();
        let token = Token::new(r.shard_id, r.shard_epoch, r.sequence_number);
        ack(self
            .engine
            .drain(&r.machine_id, token, r.grace_period_seconds)
            .await)
    }

    async fn delete(
        &self,
        request: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let r = request.into_inner();
        let token = Token::new(r.shard_id, r.shard_epoch, r.sequence_number);
        ack(self.engine.delete(&r.machine_id, token).await)
    }

    async fn get(
        &self,
        request: Request<pb::MachineRef>,
    ) -> Result<Response<EncodedMachine>, Status> {
        let machine = self.engine.get_encoded(&request.into_inner().id)?;
        self.engine.read_barrier().await?;
        Ok(Response::new(machine))
    }

    async fn list(
        &self,
        request: Request<pb::ListFilter>,
    ) -> Result<Response<EncodedMachineList>, Status> {
        let r = request.into_inner();
        let page = self
            .engine
            .list(&r.states, r.max_results, &r.since_revision);
        self.engine.read_barrier().await?;
        Ok(Response::new(page.encode()))
    }
}
