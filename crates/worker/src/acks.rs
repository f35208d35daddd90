//! Batched acknowledgements for one consumer channel.
//!
//! One `basic.ack` per message costs the broker (and the client) a frame each; an ack with
//! `multiple = true` settles every outstanding delivery up to its tag in one frame. The catch is
//! that "every outstanding delivery" includes ones whose handlers are still running, whose retry
//! copy is not confirmed yet, or which are about to be rejected: acking those would lose them.
//!
//! So one task per channel owns the window of outstanding delivery tags, in delivery order. The
//! consume loop registers each tag before its handler starts; a delivery task reports
//! [`AckSender::ack`] when its message may go (handler succeeded, or its retry copy is confirmed),
//! or [`AckSender::released`] after it settled the delivery itself (reject, nack), which it does
//! with its own frame, *before* reporting. The task acks the longest run of finished tags at the
//! front of the window with one multiple ack whose tag is the run's last *acked* tag (RabbitMQ
//! refuses a multiple ack whose own tag was already settled), and processes every report that is
//! ready before it flushes, so a burst of completions costs one frame.
//!
//! A slow handler at the front of the window would hold back every ack behind it and, once the
//! prefetch window is full of finished-but-unacked deliveries, stall the consumer. Finished tags
//! that have waited a whole [`STALE_AFTER`] tick behind an unfinished one are therefore acked one
//! by one, so a slow message costs at most that much latency to the others.

use std::collections::VecDeque;
use std::time::Duration;

use lapin::options::BasicAckOptions;
use lapin::Channel;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use crate::meters::Meters;

/// How long a finished delivery may wait behind an unfinished older one before it is acked on
/// its own (between one and two of these in practice).
pub(crate) const STALE_AFTER: Duration = Duration::from_millis(25);
/// Most reports applied before a flush, so a flood of completions cannot delay acks unboundedly.
const MAX_BATCH: usize = 1024;

enum Report {
    Register(u64),
    Ack(u64, bool),
    Released(u64),
    Flush(oneshot::Sender<()>),
}

/// Handle to a channel's ack task. Cloned into every delivery task of the session.
#[derive(Clone)]
pub(crate) struct AckSender {
    tx: mpsc::UnboundedSender<Report>,
}

impl AckSender {
    /// Starts the ack task of `channel`. It ends when every sender is dropped, after a last flush.
    pub(crate) fn spawn(channel: Channel, meters: Meters) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(channel, meters, rx));
        Self { tx }
    }

    /// A delivery arrived; must be called in delivery order, before its task can report.
    pub(crate) fn register(&self, tag: u64) {
        // A send fails only when the ack task is gone with its channel; the delivery is then
        // redelivered by the broker whatever we do.
        let _ = self.tx.send(Report::Register(tag));
    }

    /// The message may be acked; `success` when its handler succeeded (counted in
    /// `redeliver_messages_succeeded_total` once the ack is sent), false for the original of a
    /// confirmed retry copy. Returns false when the ack task is gone (channel lost).
    pub(crate) fn ack(&self, tag: u64, success: bool) -> bool {
        self.tx.send(Report::Ack(tag, success)).is_ok()
    }

    /// The delivery was settled with its own frame (reject, nack); it no longer blocks others.
    pub(crate) fn released(&self, tag: u64) {
        let _ = self.tx.send(Report::Released(tag));
    }

    /// Acks everything finished, blocked or not, and waits until those frames are written.
    pub(crate) async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Report::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Running,
    /// Finished, may be acked: the tick at which it finished, and whether it succeeded.
    Ack(u64, bool),
    /// Settled by its own task.
    Released,
}

/// The outstanding tags of a channel, oldest first. Pure bookkeeping, so it is tested alone.
#[derive(Debug, Default)]
pub(crate) struct Window {
    slots: VecDeque<(u64, Slot)>,
    tick: u64,
}

/// Frames the window asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Frames {
    /// One `basic.ack(tag, multiple = true)` and how many successes it settles.
    pub(crate) multiple: Option<(u64, u64)>,
    /// `basic.ack(tag, multiple = false)` each, with whether it is a success.
    pub(crate) single: Vec<(u64, bool)>,
}

impl Window {
    fn register(&mut self, tag: u64) {
        debug_assert!(self.slots.back().is_none_or(|(t, _)| *t < tag));
        self.slots.push_back((tag, Slot::Running));
    }

    fn set(&mut self, tag: u64, slot: Slot) {
        if let Ok(i) = self.slots.binary_search_by_key(&tag, |(t, _)| *t) {
            if self.slots[i].1 == Slot::Running {
                self.slots[i].1 = slot;
            }
        }
    }

    fn ack(&mut self, tag: u64, success: bool) {
        let tick = self.tick;
        self.set(tag, Slot::Ack(tick, success));
    }

    fn release(&mut self, tag: u64) {
        self.set(tag, Slot::Released);
    }

    /// Pops the finished run at the front: one multiple ack up to its last acked tag.
    fn take_run(&mut self) -> Option<(u64, u64)> {
        let mut last = None;
        let mut count = 0;
        while let Some(&(tag, slot)) = self.slots.front() {
            match slot {
                Slot::Running => break,
                Slot::Ack(_, success) => {
                    last = Some(tag);
                    count += u64::from(success);
                }
                Slot::Released => {}
            }
            self.slots.pop_front();
        }
        last.map(|t| (t, count))
    }

    /// The frames to send now. With `all`, every finished tag goes, however recent.
    fn frames(&mut self, all: bool) -> Frames {
        let multiple = self.take_run();
        let mut single = Vec::new();
        for (tag, slot) in self.slots.iter_mut() {
            if let Slot::Ack(since, success) = *slot {
                if all || since + 1 < self.tick {
                    single.push((*tag, success));
                    *slot = Slot::Released;
                }
            }
        }
        Frames { multiple, single }
    }

    fn next_tick(&mut self) {
        self.tick += 1;
    }
}

async fn run(channel: Channel, meters: Meters, mut rx: mpsc::UnboundedReceiver<Report>) {
    let mut window = Window::default();
    let mut tick = tokio::time::interval(STALE_AFTER);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut flushed = Vec::new();
        let all = tokio::select! {
            report = rx.recv() => {
                let Some(report) = report else {
                    // Every sender is gone: the session is over; settle what finished.
                    send(&channel, &meters, window.frames(true)).await;
                    return;
                };
                let mut all = apply(&mut window, report, &mut flushed);
                let mut n = 1;
                while n < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(report) => all |= apply(&mut window, report, &mut flushed),
                        Err(_) => break,
                    }
                    n += 1;
                }
                all
            }
            _ = tick.tick() => {
                window.next_tick();
                false
            }
        };
        send(&channel, &meters, window.frames(all)).await;
        for done in flushed {
            let _ = done.send(());
        }
    }
}

/// Applies one report; true when it asks for a full flush.
fn apply(window: &mut Window, report: Report, flushed: &mut Vec<oneshot::Sender<()>>) -> bool {
    match report {
        Report::Register(tag) => window.register(tag),
        Report::Ack(tag, success) => window.ack(tag, success),
        Report::Released(tag) => window.release(tag),
        Report::Flush(done) => {
            flushed.push(done);
            return true;
        }
    }
    false
}

async fn send(channel: &Channel, meters: &Meters, frames: Frames) {
    if let Some((tag, count)) = frames.multiple {
        let opts = BasicAckOptions { multiple: true };
        match channel.basic_ack(tag, opts).await {
            Ok(()) => meters.succeeded.increment(count),
            Err(e) => failed(channel, meters, &e),
        }
    }
    for (tag, success) in frames.single {
        match channel.basic_ack(tag, BasicAckOptions::default()).await {
            Ok(()) => meters.succeeded.increment(u64::from(success)),
            Err(e) => failed(channel, meters, &e),
        }
    }
}

/// Failed acks are counted per frame: the broker redelivers every message the frame covered.
fn failed(channel: &Channel, meters: &Meters, e: &lapin::Error) {
    meters.settle_failures.increment(1);
    if channel.status().connected() {
        warn!(error = %e, "ack failed; the broker will redeliver the messages it covered");
    } else {
        debug!(error = %e, "acks not sent: the channel is closed; the broker will redeliver");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(tags: std::ops::RangeInclusive<u64>) -> Window {
        let mut w = Window::default();
        for t in tags {
            w.register(t);
        }
        w
    }

    #[test]
    fn a_run_at_the_front_is_one_multiple_ack() {
        let mut w = window(1..=5);
        w.ack(2, true);
        w.ack(1, true);
        w.ack(3, true);
        assert_eq!(
            w.frames(false),
            Frames {
                multiple: Some((3, 3)),
                single: vec![]
            }
        );
        assert_eq!(w.frames(false), Frames::default());
        w.ack(5, true);
        assert_eq!(w.frames(false).multiple, None, "4 is still running");
        w.ack(4, true);
        assert_eq!(w.frames(false).multiple, Some((5, 2)));
        assert!(w.slots.is_empty());
    }

    #[test]
    fn never_acks_past_a_running_or_unreleased_tag() {
        let mut w = window(1..=4);
        w.ack(1, true);
        w.ack(3, true);
        w.ack(4, true);
        // 2 is being rejected by its task: not released yet, so 3 and 4 wait.
        assert_eq!(w.frames(false).multiple, Some((1, 1)));
        w.release(2);
        assert_eq!(w.frames(false).multiple, Some((4, 2)));
    }

    #[test]
    fn the_multiple_tag_is_the_last_acked_one_not_a_released_one() {
        let mut w = window(1..=3);
        w.ack(1, true);
        w.release(2);
        w.release(3);
        // Tag 3 was settled with its own frame: RabbitMQ would refuse ack(3, multiple).
        assert_eq!(w.frames(false).multiple, Some((1, 1)));
        assert!(w.slots.is_empty());
        let mut w = window(1..=2);
        w.release(1);
        w.release(2);
        assert_eq!(w.frames(false), Frames::default());
    }

    #[test]
    fn finished_tags_behind_a_slow_one_go_alone_after_a_tick() {
        let mut w = window(1..=3);
        w.ack(2, true);
        w.ack(3, true);
        assert_eq!(w.frames(false), Frames::default());
        w.next_tick();
        assert_eq!(
            w.frames(false),
            Frames::default(),
            "finished less than a tick ago"
        );
        w.next_tick();
        assert_eq!(w.frames(false).single, vec![(2, true), (3, true)]);
        // Once acked alone they only count as released: the slow one's ack must not cover them.
        w.ack(1, true);
        assert_eq!(w.frames(false).multiple, Some((1, 1)));
    }

    #[test]
    fn a_full_flush_sends_every_finished_tag() {
        let mut w = window(1..=3);
        w.ack(3, true);
        assert_eq!(
            w.frames(true),
            Frames {
                multiple: None,
                single: vec![(3, true)]
            }
        );
        assert_eq!(w.slots.len(), 3, "released, but still behind running ones");
    }

    #[test]
    fn only_successes_are_counted() {
        let mut w = window(1..=3);
        w.ack(1, true);
        w.ack(2, false);
        w.ack(3, true);
        assert_eq!(w.frames(false).multiple, Some((3, 2)));
    }

    #[test]
    fn unknown_and_repeated_reports_are_ignored() {
        let mut w = window(5..=6);
        w.ack(4, true);
        w.ack(9, true);
        w.release(5);
        w.ack(5, true);
        assert_eq!(w.frames(false), Frames::default());
        w.ack(6, true);
        assert_eq!(w.frames(false).multiple, Some((6, 1)));
    }
}
