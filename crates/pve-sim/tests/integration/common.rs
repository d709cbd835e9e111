//! The simulator's HTTP API as the tests call it: a client trusting the
//! simulator's CA, form or query encoding, and polling helpers.

use std::time::Duration;

use provider_testkit::wait::Wait;
use pve_sim::{PveSim, SimConfig};
use serde_json::Value;

/// The simulator started with `cfg`, and a client of its API.
pub async fn start_sim(cfg: SimConfig) -> (PveSim, Api) {
    let sim = PveSim::start(cfg).await.expect("simulator");
    let api = Api::new(&sim);
    (sim, api)
}

/// Asserts that every request the simulator answered matched PVE's
/// schema, then shuts it down.
pub async fn shutdown_clean(sim: PveSim) {
    assert!(
        sim.schema_violations().is_empty(),
        "{:?}",
        sim.schema_violations()
    );
    sim.shutdown().await;
}

pub struct Api {
    pub c: reqwest::Client,
    pub base: String,
    pub auth: Option<String>,
}

pub struct Resp {
    pub status: u16,
    pub body: Value,
}

impl Resp {
    pub fn data(&self) -> &Value {
        &self.body["data"]
    }

    pub fn message(&self) -> String {
        self.body["message"]
            .as_str()
            .unwrap_or_default()
            .trim()
            .to_string()
    }
}

impl Api {
    pub fn new(sim: &PveSim) -> Self {
        let ca = reqwest::Certificate::from_pem(sim.ca_pem().as_bytes()).expect("CA pem");
        let c = reqwest::Client::builder()
            .add_root_certificate(ca)
            .build()
            .expect("client");
        Self {
            c,
            base: sim.base_url(),
            auth: Some(sim.auth_header()),
        }
    }

    pub async fn call(&self, method: reqwest::Method, path: &str, form: &[(&str, &str)]) -> Resp {
        let url = format!("{}{}", self.base, path);
        let rb = if method == reqwest::Method::GET || method == reqwest::Method::DELETE {
            let q: Vec<(&str, &str)> = form.to_vec();
            self.c.request(method, &url).query(&q)
        } else {
            let body: String = form_urlencoded::Serializer::new(String::new())
                .extend_pairs(form.iter())
                .finish();
            self.c
                .request(method, &url)
                .header("content-type", "application/x-www-form-urlencoded")
                .body(body)
        };
        self.send(rb).await
    }

    /// POST `body` exactly as given, as a form.
    pub async fn post_raw(&self, path: &str, body: &str) -> Resp {
        let rb = self
            .c
            .post(format!("{}{}", self.base, path))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.to_string());
        self.send(rb).await
    }

    /// Sends `rb` with the token (when there is one); the status and the
    /// JSON body (null when it is not JSON).
    async fn send(&self, mut rb: reqwest::RequestBuilder) -> Resp {
        if let Some(a) = &self.auth {
            rb = rb.header("authorization", a);
        }
        let r = rb.send().await.expect("request");
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        Resp { status, body }
    }

    pub async fn get(&self, path: &str, q: &[(&str, &str)]) -> Resp {
        self.call(reqwest::Method::GET, path, q).await
    }
    pub async fn post(&self, path: &str, f: &[(&str, &str)]) -> Resp {
        self.call(reqwest::Method::POST, path, f).await
    }
    pub async fn put(&self, path: &str, f: &[(&str, &str)]) -> Resp {
        self.call(reqwest::Method::PUT, path, f).await
    }
    pub async fn delete(&self, path: &str, q: &[(&str, &str)]) -> Resp {
        self.call(reqwest::Method::DELETE, path, q).await
    }

    /// Poll a task until it stops; returns its status object.
    pub async fn wait_task(&self, upid: &str) -> Value {
        let node = upid.split(':').nth(1).expect("node in upid").to_string();
        let path = format!("/nodes/{node}/tasks/{}/status", urlencode(upid));
        Wait::new(format!("task {upid} to stop"), Duration::from_secs(20))
            .every(Duration::from_millis(10))
            .ok_async(|| async {
                let r = self.get(&path, &[]).await;
                assert_eq!(r.status, 200, "task status: {:?}", r.body);
                if r.data()["status"] == "stopped" {
                    Ok(r.data().clone())
                } else {
                    Err(r.body)
                }
            })
            .await
    }

    /// A task's log lines, joined by newlines.
    pub async fn task_log_text(&self, upid: &str) -> String {
        let node = upid.split(':').nth(1).expect("node in upid").to_string();
        let r = self
            .get(
                &format!("/nodes/{node}/tasks/{}/log", urlencode(upid)),
                &[("limit", "500")],
            )
            .await;
        assert_eq!(r.status, 200, "task log: {:?}", r.body);
        r.data()
            .as_array()
            .map(|lines| {
                lines
                    .iter()
                    .filter_map(|l| l["t"].as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    }

    /// Poll until `f` accepts the response of `GET path`.
    pub async fn wait_for(
        &self,
        what: &str,
        mut f: impl FnMut() -> (reqwest::Method, String),
        ok: impl Fn(&Resp) -> bool,
    ) -> Resp {
        Wait::new(what, Duration::from_secs(20))
            .every(Duration::from_millis(10))
            .ok_async(|| {
                let (m, p) = f();
                let ok = &ok;
                async move {
                    let r = self.call(m, &p, &[]).await;
                    if ok(&r) {
                        Ok(r)
                    } else {
                        Err(r.body)
                    }
                }
            })
            .await
    }

    /// Wait for the task a response started (asserting it was accepted).
    pub async fn wait_task_of(&self, resp: Resp) -> Value {
        assert_eq!(resp.status, 200, "{:?}", resp.body);
        let upid = resp.data().as_str().expect("upid").to_string();
        self.wait_task(&upid).await
    }

    /// Poll `method path` until `ok` accepts the response.
    pub async fn poll(
        &self,
        what: &str,
        method: reqwest::Method,
        path: &str,
        ok: impl Fn(&Resp) -> bool,
    ) -> Resp {
        self.wait_for(what, || (method.clone(), path.to_string()), ok)
            .await
    }

    pub async fn exec(&self, vmid: u32, argv: &[&str]) -> Resp {
        let form: Vec<(&str, &str)> = argv.iter().map(|a| ("command", *a)).collect();
        self.post(&format!("/nodes/pve1/qemu/{vmid}/agent/exec"), &form)
            .await
    }

    /// Exec and wait for the exit; returns the exec-status data.
    pub async fn run(&self, vmid: u32, argv: &[&str]) -> Value {
        let r = self.exec(vmid, argv).await;
        assert_eq!(r.status, 200, "exec {argv:?}: {:?}", r.body);
        let pid = r.data()["pid"].as_u64().expect("pid");
        let path = format!("/nodes/pve1/qemu/{vmid}/agent/exec-status?pid={pid}");
        self.poll("exec exit", reqwest::Method::GET, &path, |r| {
            r.status != 200 || r.data()["exited"] == 1
        })
        .await
        .data()
        .clone()
    }
}

pub fn urlencode(s: &str) -> String {
    percent_encode(s)
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
