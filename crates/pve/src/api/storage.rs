//! A node's storages: the list (type, shared flag, capacity) and one
//! storage's status.

use http::Method;

use crate::client::PveClient;
use crate::error::PveError;
use crate::form::{encode_segment, Params};
use crate::types::StorageStatus;

impl PveClient {
    /// `GET /nodes/{node}/storage`: every storage the node sees, with type,
    /// shared flag and capacity.
    pub async fn node_storages(&self, node: &str) -> Result<Vec<StorageStatus>, PveError> {
        let path = format!("/nodes/{}/storage", encode_segment(node));
        self.call("node_storages", Method::GET, &path, &Params::new())
            .await
    }

    /// `GET /nodes/{node}/storage/{storage}/status`.
    pub async fn storage_status(
        &self,
        node: &str,
        storage: &str,
    ) -> Result<StorageStatus, PveError> {
        let path = format!(
            "/nodes/{}/storage/{}/status",
            encode_segment(node),
            encode_segment(storage)
        );
        let mut st: StorageStatus = self
            .call("storage_status", Method::GET, &path, &Params::new())
            .await?;
        st.storage.get_or_insert_with(|| storage.to_string());
        Ok(st)
    }
}
