//! What the token may see: its effective privileges, and the members of a
//! pool (PVE files pools under permissions: a pool-scoped token sees only
//! its pool's VMs).

use std::collections::BTreeMap;

use http::Method;
use serde::Deserialize;
use serde_json::Value;

use crate::client::PveClient;
use crate::error::PveError;
use crate::form::{encode_segment, Params};
use crate::types::{Permissions, PoolMember};

#[derive(Deserialize)]
struct PoolEntry {
    #[serde(default)]
    poolid: String,
    #[serde(default)]
    members: Vec<PoolMember>,
}

#[derive(Deserialize)]
struct PoolRead {
    #[serde(default)]
    members: Vec<PoolMember>,
}

impl PveClient {
    /// `GET /access/permissions[?path=P]`: the calling token's effective
    /// privileges, for one path or for every path PVE lists.
    pub async fn permissions(&self, path: Option<&str>) -> Result<Permissions, PveError> {
        let mut p = Params::new();
        p.push_opt("path", path.map(str::to_string));
        let raw: BTreeMap<String, BTreeMap<String, Value>> = self
            .call("permissions", Method::GET, "/access/permissions", &p)
            .await?;
        Ok(raw
            .into_iter()
            .map(|(path, privs)| (path, privs.into_keys().collect()))
            .collect())
    }

    /// Members of a pool: `GET /pools?poolid=P`, falling back to the older
    /// `GET /pools/{P}` when the server lacks the former (404/501, or 400
    /// rejecting the `poolid` parameter).
    pub async fn pool_members(&self, pool: &str) -> Result<Vec<PoolMember>, PveError> {
        let mut p = Params::new();
        p.push("poolid", pool);
        match self
            .call::<Vec<PoolEntry>>("pools", Method::GET, "/pools", &p)
            .await
        {
            Ok(list) => list
                .into_iter()
                .find(|e| e.poolid == pool)
                .map(|e| e.members)
                .ok_or_else(|| PveError::NotFound(format!("pool {pool:?}"))),
            Err(PveError::Api {
                status,
                param_errors,
                ..
            }) if matches!(status, 404 | 501)
                || (status == 400 && param_errors.contains_key("poolid")) =>
            {
                let path = format!("/pools/{}", encode_segment(pool));
                let r: PoolRead = self
                    .call("pool_read", Method::GET, &path, &Params::new())
                    .await?;
                Ok(r.members)
            }
            Err(e) => Err(e),
        }
    }
}
