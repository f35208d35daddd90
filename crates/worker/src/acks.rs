//! Batched acknowledgements for one consumer channel.
//!
//! One `basic.ack` per message costs the broker (and the client) a frame each; an ack with
//! `multiple = true` settles every outstanding delivery up to its tag in one frame. The catch is
//! that "every outstanding delivery" includes ones whose handlers are still running, whose retry
//! copy is not confirmed yet, or which are about to be rejected: acking those would lose them.
//!
//! So each channel has a window of outstanding delivery tags, in delivery order, shared (under a
//! short mutex) by the consume loop, the delivery tasks and one ack task. The consume loop
//! registers each tag before its handler starts; a delivery task marks it with [`AckSender::ack`]
//! when its message may go (handler succeeded, or its retry copy is confirmed), or
//! [`AckSender::released`] after it settled the delivery itself (reject, nack), which it does with
//! its own frame, *before* marking. The ack task acks the longest run of finished tags at the
//! front of the window with one multiple ack whose tag is the run's last *acked* tag (RabbitMQ
//! refuses a multiple ack whose own tag was already settled). Only that task sends acks, so
//! multiple acks leave in tag order; it is woken only when there is something to send, not once
//! per message.
//!
//! A run is sent once it holds a tenth of the prefetch (RabbitMQ's advice: ack every 5-10 % of
//! the prefetch), or after lingering [`LINGER`] (what a quiet consumer waits for its ack):
//! sending each small run as soon as it forms costs the broker a frame per few messages.
//!
//! A slow handler at the front of the window would hold back every ack behind it and, once the
//! prefetch window is full of finished-but-unacked deliveries, stall the consumer. Finished tags
//! that have waited a whole [`STALE_AFTER`] tick behind an unfinished one are therefore acked one
//! by one, so a slow message costs at most that much latency to the others.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lapin::options::BasicAckOptions;
use lapin::Channel;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::meters::Meters;

/// How long a finished delivery may wait behind an unfinished older one before it is acked on
/// its own (between one and two of these in practice).
const STALE_AFTER: Duration = Duration::from_millis(25);
/// Longest a finished run below the batch size waits for more completions.
const LINGER: Duration = Duration::from_millis(2);

/// What the consume loop, the delivery tasks and the ack task share.
struct State {
    window: Window,
    /// Runs are due at this many finished tags.
    batch: usize,
    /// The ack task holds a run back and has a linger timer for it: no need to wake it again.
    lingering: bool,
    /// Callers of [`AckSender::flush`] waiting for everything finished to be sent.
    flushes: Vec<oneshot::Sender<()>>,
    /// The session is over: send what finished and stop.
    closed: bool,
}

/// Where the consume loop and the delivery tasks leave work for the ack task: the [`State`]
/// under its lock, and the notification that wakes the task.
struct AckMailbox {
    state: Mutex<State>,
    wake: Notify,
}

impl AckMailbox {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The critical sections cannot panic half-way through an update that matters: a
        // poisoned lock still holds a usable window.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The ack side of one consumer channel, owned by its session: dropping it ends the ack task
/// after a last flush.
pub(crate) struct AckSender {
    mailbox: Arc<AckMailbox>,
    channel: Channel,
}

impl AckSender {
    /// Starts the ack task of `channel`, whose consumer has `prefetch`.
    pub(crate) fn spawn(channel: Channel, meters: Meters, prefetch: u16) -> Self {
        let mailbox = Arc::new(AckMailbox {
            state: Mutex::new(State {
                window: Window::default(),
                batch: usize::from(prefetch / 10).max(1),
                lingering: false,
                flushes: Vec::new(),
                closed: false,
            }),
            wake: Notify::new(),
        });
        tokio::spawn(run(channel.clone(), meters, Arc::clone(&mailbox)));
        Self { mailbox, channel }
    }

    /// A delivery arrived; must be called in delivery order, before its task can mark it.
    pub(crate) fn register(&self, tag: u64) {
        self.mailbox.lock().window.register(tag);
    }

    /// The message may be acked; `success` when its handler succeeded (counted in
    /// `redeliver_messages_succeeded_total` once the ack is sent), false for the original of a
    /// confirmed retry copy.
    pub(crate) fn ack(&self, tag: u64, success: bool) {
        let mut st = self.mailbox.lock();
        st.window.ack(tag, success);
        self.wake_if_needed(st);
    }

    /// A delivery's own frame (reject, nack) did not go out, so its tag must stay unsettled
    /// and no later multiple ack may cover it: the channel is closed, and the broker returns
    /// every delivery of it to the queue (the session then reconnects).
    pub(crate) async fn abandon_channel(&self, why: &str) {
        if self.channel.status().connected() {
            let _ =
                tokio::time::timeout(Duration::from_secs(5), self.channel.close(406, why.into()))
                    .await;
        }
    }

    /// The delivery was settled with its own frame (reject, nack); it no longer blocks others.
    pub(crate) fn released(&self, tag: u64) {
        let mut st = self.mailbox.lock();
        st.window.release(tag);
        self.wake_if_needed(st);
    }

    fn wake_if_needed(&self, st: MutexGuard<'_, State>) {
        // Lingering, the ack task needs waking only for a full batch; otherwise for any run,
        // so that it starts lingering.
        let wake = st
            .window
            .front_run_reaches(if st.lingering { st.batch } else { 1 });
        drop(st);
        if wake {
            self.mailbox.wake.notify_one();
        }
    }

    /// Acks everything finished, blocked or not, and waits until those frames are written.
    pub(crate) async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        self.mailbox.lock().flushes.push(done);
        self.mailbox.wake.notify_one();
        let _ = wait.await;
    }
}

impl Drop for AckSender {
    fn drop(&mut self) {
        self.mailbox.lock().closed = true;
        self.mailbox.wake.notify_one();
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Running,
    /// Finished, may be acked: the tick at which it finished, and whether it succeeded.
    Ack(u64, bool),
}

/// The tags of a channel not settled yet, oldest first. A tag settled by its own frame (a reject,
/// a nack, an ack sent alone) leaves the window at once: a later multiple ack may cover it, since
/// the broker ignores settled tags below the one it names, and keeping it would let the window
/// grow without bound behind a delivery that never finishes. Pure bookkeeping, so it is tested
/// alone.
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

    /// Index of a running `tag`; `None` for a tag unknown or already finished, so repeated
    /// reports are ignored.
    fn running(&self, tag: u64) -> Option<usize> {
        // Tags are consecutive until one leaves from the middle: then its offset from the front
        // is its index, and the search is for the rest.
        let front = self.slots.front()?.0;
        let i = usize::try_from(tag.checked_sub(front)?)
            .ok()
            .filter(|&i| self.slots.get(i).is_some_and(|(t, _)| *t == tag))
            .or_else(|| self.slots.binary_search_by_key(&tag, |(t, _)| *t).ok())?;
        (self.slots[i].1 == Slot::Running).then_some(i)
    }

    fn ack(&mut self, tag: u64, success: bool) {
        if let Some(i) = self.running(tag) {
            self.slots[i].1 = Slot::Ack(self.tick, success);
        }
    }

    fn release(&mut self, tag: u64) {
        if let Some(i) = self.running(tag) {
            self.slots.remove(i);
        }
    }

    /// Pops the finished run at the front: one multiple ack up to its last tag.
    fn take_run(&mut self) -> Option<(u64, u64)> {
        let mut last = None;
        let mut count = 0;
        while let Some(&(tag, Slot::Ack(_, success))) = self.slots.front() {
            last = Some(tag);
            count += u64::from(success);
            self.slots.pop_front();
        }
        last.map(|t| (t, count))
    }

    /// Whether the finished run at the front holds at least `n` tags, looking no further.
    fn front_run_reaches(&self, n: usize) -> bool {
        self.slots
            .iter()
            .take_while(|(_, slot)| *slot != Slot::Running)
            .nth(n.saturating_sub(1))
            .is_some()
    }

    /// The frames to send now: the run at the front when `with_run`, and finished tags stuck
    /// behind an unfinished one for a whole tick. With `all`, everything finished goes.
    fn frames(&mut self, all: bool, with_run: bool) -> Frames {
        let multiple = if all || with_run {
            self.take_run()
        } else {
            None
        };
        let tick = self.tick;
        let mut single = Vec::new();
        self.slots.retain(|&(tag, slot)| match slot {
            Slot::Ack(since, success) if all || since + 1 < tick => {
                single.push((tag, success));
                false
            }
            _ => true,
        });
        Frames { multiple, single }
    }

    fn next_tick(&mut self) {
        self.tick += 1;
    }
}

async fn run(channel: Channel, meters: Meters, mailbox: Arc<AckMailbox>) {
    let mut tick = tokio::time::interval(STALE_AFTER);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Since when a run below the batch size has been held back.
    let mut held_since: Option<Instant> = None;
    loop {
        let linger = async {
            match held_since {
                Some(t) => tokio::time::sleep_until(t + LINGER).await,
                None => std::future::pending().await,
            }
        };
        let mut lingered = false;
        tokio::select! {
            _ = mailbox.wake.notified() => {}
            _ = linger => lingered = true,
            _ = tick.tick() => mailbox.lock().window.next_tick(),
        }
        let (frames, flushes, closed) = {
            let mut st = mailbox.lock();
            let flushes = std::mem::take(&mut st.flushes);
            let all = st.closed || !flushes.is_empty();
            let with_run = lingered || st.window.front_run_reaches(st.batch);
            let frames = st.window.frames(all, with_run);
            held_since = match held_since {
                _ if !st.window.front_run_reaches(1) => None,
                Some(t) => Some(t),
                None => Some(Instant::now()),
            };
            st.lingering = held_since.is_some();
            (frames, flushes, st.closed)
        };
        send(&channel, &meters, frames).await;
        for done in flushes {
            let _ = done.send(());
        }
        if closed {
            return;
        }
    }
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
            w.frames(false, true),
            Frames {
                multiple: Some((3, 3)),
                single: vec![]
            }
        );
        assert_eq!(w.frames(false, true), Frames::default());
        w.ack(5, true);
        assert_eq!(w.frames(false, true).multiple, None, "4 is still running");
        w.ack(4, true);
        assert_eq!(w.frames(false, true).multiple, Some((5, 2)));
        assert!(w.slots.is_empty());
    }

    #[test]
    fn finds_tags_after_one_left_from_the_middle() {
        let mut w = window(10..=15);
        w.release(12);
        // Offsets from the front no longer match past 12: the lookup falls back to a search.
        w.ack(14, true);
        w.ack(10, true);
        w.ack(15, true);
        w.ack(12, true);
        w.ack(9, true);
        w.ack(16, true);
        assert_eq!(w.frames(false, true).multiple, Some((10, 1)));
        w.ack(11, true);
        w.ack(13, false);
        assert_eq!(w.frames(false, true).multiple, Some((15, 3)));
        assert!(w.slots.is_empty());
    }

    #[test]
    fn never_acks_past_a_running_or_unreleased_tag() {
        let mut w = window(1..=4);
        w.ack(1, true);
        w.ack(3, true);
        w.ack(4, true);
        // 2 is being rejected by its task: not released yet, so 3 and 4 wait.
        assert_eq!(w.frames(false, true).multiple, Some((1, 1)));
        w.release(2);
        assert_eq!(w.frames(false, true).multiple, Some((4, 2)));
    }

    #[test]
    fn the_multiple_tag_is_the_last_acked_one_not_a_released_one() {
        let mut w = window(1..=3);
        w.ack(1, true);
        w.release(2);
        w.release(3);
        // Tag 3 was settled with its own frame: RabbitMQ would refuse ack(3, multiple).
        assert_eq!(w.frames(false, true).multiple, Some((1, 1)));
        assert!(w.slots.is_empty());
        let mut w = window(1..=2);
        w.release(1);
        w.release(2);
        assert_eq!(w.frames(false, true), Frames::default());
    }

    #[test]
    fn finished_tags_behind_a_slow_one_go_alone_after_a_tick() {
        let mut w = window(1..=3);
        w.ack(2, true);
        w.ack(3, true);
        assert_eq!(w.frames(false, true), Frames::default());
        w.next_tick();
        assert_eq!(
            w.frames(false, true),
            Frames::default(),
            "finished less than a tick ago"
        );
        w.next_tick();
        assert_eq!(w.frames(false, true).single, vec![(2, true), (3, true)]);
        // Once acked alone they only count as released: the slow one's ack must not cover them.
        w.ack(1, true);
        assert_eq!(w.frames(false, true).multiple, Some((1, 1)));
    }

    #[test]
    fn a_full_flush_sends_every_finished_tag() {
        let mut w = window(1..=3);
        w.ack(3, true);
        assert_eq!(
            w.frames(true, true),
            Frames {
                multiple: None,
                single: vec![(3, true)]
            }
        );
        assert_eq!(w.slots.len(), 2, "acked alone, so no longer tracked");
    }

    #[test]
    fn the_window_stays_bounded_behind_a_delivery_that_never_finishes() {
        let mut w = window(1..=1);
        for tag in 2..=10_000 {
            w.register(tag);
            w.ack(tag, true);
            w.next_tick();
            w.next_tick();
            assert_eq!(w.frames(false, false).single, vec![(tag, true)]);
        }
        assert_eq!(w.slots.len(), 1, "only the stuck one is tracked");
        w.ack(1, true);
        assert_eq!(w.frames(false, true).multiple, Some((1, 1)));
    }

    #[test]
    fn a_short_run_waits_for_a_batch_unless_told() {
        let mut w = window(1..=4);
        w.ack(1, true);
        w.ack(2, true);
        assert!(w.front_run_reaches(2));
        assert!(
            !w.front_run_reaches(3),
            "2 of a batch of 3, and 3 and 4 still run"
        );
        assert_eq!(w.frames(false, false), Frames::default(), "held back");
        w.ack(3, true);
        assert!(w.front_run_reaches(3), "a full batch");
        w.release(4);
        assert!(
            !w.front_run_reaches(4),
            "released tags do not count towards a batch"
        );
        assert_eq!(w.frames(false, true).multiple, Some((3, 3)));
        assert!(!w.front_run_reaches(1));
    }

    #[test]
    fn only_successes_are_counted() {
        let mut w = window(1..=3);
        w.ack(1, true);
        w.ack(2, false);
        w.ack(3, true);
        assert_eq!(w.frames(false, true).multiple, Some((3, 2)));
    }

    #[test]
    fn unknown_and_repeated_reports_are_ignored() {
        let mut w = window(5..=6);
        w.ack(4, true);
        w.ack(9, true);
        w.release(5);
        w.ack(5, true);
        assert_eq!(w.frames(false, true), Frames::default());
        w.ack(6, true);
        assert_eq!(w.frames(false, true).multiple, Some((6, 1)));
    }
}
