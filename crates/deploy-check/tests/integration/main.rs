//! deploy-check's tests, one binary (each file a module): the container
//! image (its Dockerfile, and booting its root filesystem), the Helm chart
//! (rendered, checked against Kubernetes' schemas, and booting the real
//! binary), the monitoring files, the host setup script, the live metrics,
//! and the operator docs (their examples, every flag and default they name,
//! every gRPC code they state, every example command run or listed with why
//! it cannot be, and every log line troubleshooting quotes).

mod common;

mod chart_boots_binary;
mod design_doc;
mod doc_codes;
mod doc_commands;
mod doc_flags;
mod doc_logs;
mod dockerfile;
mod docs_examples;
mod file_size;
mod helm_chart;
mod host_setup;
mod image_rootfs;
mod kubernetes_validate;
mod live_metrics;
mod monitoring;
