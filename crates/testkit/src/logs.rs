//! The `tracing` events code under test emits in this process, captured so
//! a test can await one (the mark that something happened) instead of
//! sleeping until it probably has.
//!
//! The capture is the calling thread's default subscriber, not a global
//! one: it sees what runs on that thread (every task of a current-thread
//! tokio runtime, as `#[tokio::test]` builds), and tests running beside it
//! in the same binary keep their own.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tracing::field::{Field, Visit};
use tracing::subscriber::DefaultGuard;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// One captured event: where it came from, its level, its message and its
/// other fields, each as a log line would show it (its `Debug` form, so a
/// field recorded as `?Some(0)` reads `Some(0)` here as it would there).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub target: String,
    pub level: tracing::Level,
    pub message: String,
    pub fields: Vec<(String, String)>,
}

impl Event {
    /// The value of field `name`, as the line shows it.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Events captured on this thread since [`capture`]; capturing stops when
/// it is dropped.
pub struct Capture {
    events: Arc<Mutex<Vec<Event>>>,
    _installed: DefaultGuard,
}

/// Starts capturing every event (all levels) emitted on this thread.
pub fn capture() -> Capture {
    let events = Arc::new(Mutex::new(Vec::new()));
    let recorder = Recorder {
        events: Arc::clone(&events),
    };
    let installed = tracing::subscriber::set_default(tracing_subscriber::registry().with(recorder));
    Capture {
        events,
        _installed: installed,
    }
}

impl Capture {
    /// The events captured so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().clone()
    }

    /// How many events from a target starting with `target` had `message`.
    pub fn count(&self, target: &str, message: &str) -> usize {
        self.events
            .lock()
            .iter()
            .filter(|e| e.target.starts_with(target) && e.message == message)
            .count()
    }

    /// Waits until `n` events from `target` had `message`; fails the test
    /// after `within`.
    pub async fn wait_for(&self, target: &str, message: &str, n: usize, within: Duration) {
        let what = format!("{n} {target} event(s) {message:?}");
        crate::wait::until(&what, within, || self.count(target, message) >= n).await
    }
}

struct Recorder {
    events: Arc<Mutex<Vec<Event>>>,
}

impl<S: tracing::Subscriber> Layer<S> for Recorder {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        self.events.lock().push(Event {
            target: event.metadata().target().to_string(),
            level: *event.metadata().level(),
            message: fields.message,
            fields: fields.others,
        });
    }
}

/// The `message` field of an event, as written, and the others.
#[derive(Default)]
struct Fields {
    message: String,
    others: Vec<(String, String)>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_string();
        } else {
            self.others
                .push((field.name().to_string(), value.to_string()));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            self.others
                .push((field.name().to_string(), format!("{value:?}")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sees_events_of_tasks_on_this_thread_and_awaits_them() {
        let logs = capture();
        tracing::debug!(n = 1, "before");
        let task = tokio::spawn(async {
            tokio::task::yield_now().await;
            tracing::info!(target: "elsewhere", "from a task");
        });
        logs.wait_for("elsewhere", "from a task", 1, Duration::from_secs(10))
            .await;
        task.await.expect("task");
        assert_eq!(logs.count(module_path!(), "before"), 1);
        assert_eq!(logs.count("elsewhere", "before"), 0);
        assert_eq!(
            logs.events().last(),
            Some(&Event {
                target: "elsewhere".into(),
                level: tracing::Level::INFO,
                message: "from a task".into(),
                fields: Vec::new(),
            })
        );
        let before = &logs.events()[0];
        assert_eq!(before.field("n"), Some("1"));
        assert_eq!(before.level, tracing::Level::DEBUG);
    }
}
