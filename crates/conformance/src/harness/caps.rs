//! What the endpoint supports, probed over the wire.

use anyhow::{bail, Context as _};
use bigfleet_proto::v1alpha1::{DeleteRequest, ListFilter};
use tonic::Code;

use super::Client;

/// Probed endpoint capabilities.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Capabilities {
    pub delete: bool,
    pub since_revision: bool,
    pub fleet_size: usize,
}

impl Capabilities {
    pub fn has(&self, gate: &str) -> bool {
        match gate {
            "Delete" => self.delete,
            "SinceRevision" => self.since_revision,
            _ => false,
        }
    }
}

/// Probes Delete (NOT_FOUND on an unknown id = supported, UNIMPLEMENTED = not) and the revision
/// cursor (a non-empty revision whose immediate delta is smaller than the full list).
pub async fn probe(client: &Client) -> anyhow::Result<Capabilities> {
    let mut c = client.clone();
    let delete = match c
        .delete(DeleteRequest {
            machine_id: "bfconf-probe-unknown-machine".into(),
            ..Default::default()
        })
        .await
    {
        Err(s) if s.code() == Code::Unimplemented => false,
        Err(s) if s.code() == Code::NotFound => true,
        Err(s) => bail!(
            "capability probe: Delete of an unknown id returned {:?}: {}",
            s.code(),
            s.message()
        ),
        Ok(_) => bail!("capability probe: Delete of an unknown id succeeded"),
    };
    let full = c
        .list(ListFilter::default())
        .await
        .context("capability probe: List")?
        .into_inner();
    let since_revision = if full.revision.is_empty() {
        false
    } else {
        let delta = c
            .list(ListFilter {
                since_revision: full.revision.clone(),
                ..Default::default()
            })
            .await
            .context("capability probe: delta List")?
            .into_inner();
        full.machines.is_empty() || delta.machines.len() < full.machines.len()
    };
    Ok(Capabilities {
        delete,
        since_revision,
        fleet_size: full.machines.len(),
    })
}
