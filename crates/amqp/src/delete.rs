//! Deleting the delay infrastructure while other services may still use it: queues that hold
//! messages are kept unless the caller discards them, and a queue is deleted only once nothing
//! can reach it any more and it was found empty then.

use std::time::Duration;

use crate::declare::{Op, Session};
use crate::delay::DelayConfig;
use crate::error::TopologyError;
use crate::topology::Topology;

/// What [`DelayConfig::delete_checked`] does with delay queues that hold messages.
///
/// The delay infrastructure of a prefix is shared: its level queues hold other services'
/// pending retries (whose originals are already acknowledged, so a deleted retry is lost), and
/// its parking queue holds messages an operator has yet to replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HeldMessages {
    /// Delete nothing while any delay queue holds messages:
    /// [`TopologyError::DelayNotEmpty`], naming them.
    #[default]
    Refuse,
    /// Delete every delay queue with its messages, and report which held how many.
    Discard,
}

/// A queue and the ready messages it held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueMessages {
    /// The queue's name.
    pub queue: String,
    /// Its ready messages when it was counted or deleted.
    pub messages: u32,
}

/// How long a publish the broker routed before a binding or an exchange went away may still be
/// on its way to the queue (measured in milliseconds; a loaded node is slower).
const IN_FLIGHT: Duration = Duration::from_secs(1);

impl DelayConfig {
    /// Deletes the delay infrastructure of this prefix (every level exchange and queue, the
    /// deliver exchange, the parking exchange and queue, the settings exchange); objects that do
    /// not exist are skipped. Returns the queues deleted with their messages, which only
    /// [`HeldMessages::Discard`] does.
    ///
    /// With [`HeldMessages::Refuse`], nothing is deleted when a delay queue holds messages
    /// ([`TopologyError::DelayNotEmpty`]), and messages that arrive while deleting are not
    /// deleted either. The broker cannot do that check for us: `queue.delete` with `if-empty`
    /// is refused on quorum queues (the default level type and always the parking queue's) by
    /// RabbitMQ 3.10 to 4.3 ("not supported by quorum queues", NOT_IMPLEMENTED, which closes
    /// the whole connection). So the way in is closed first: a level queue receives only
    /// through its exchange's binding, which is removed, and the queue is counted again after a
    /// pause for publishes already routed (RabbitMQ would even confirm a retry routed to a queue
    /// deleted meanwhile). If one has arrived, the bindings are put back and nothing is
    /// deleted. A retry routed to a level meanwhile goes to the level exchange's alternate
    /// exchange, the parking queue, which is counted again after every exchange that could
    /// route to it is gone; if it holds messages then, it is kept with them
    /// ([`TopologyError::DelayNotEmpty`] lists what was deleted).
    ///
    /// Takes a second or two with [`HeldMessages::Refuse`] (the pauses for messages in flight).
    ///
    /// ```no_run
    /// # async fn demo(conn: &redeliver_amqp::lapin::Connection) -> Result<(), redeliver_amqp::TopologyError> {
    /// use redeliver_amqp::{DelayConfig, HeldMessages, TopologyError};
    ///
    /// let delay = DelayConfig::new().prefix("staging.");
    /// match delay.delete_checked(conn, HeldMessages::Refuse).await {
    ///     Ok(_) => println!("deleted"),
    ///     Err(TopologyError::DelayNotEmpty { non_empty, .. }) => {
    ///         for q in non_empty {
    ///             println!("kept '{}': {} message(s)", q.queue, q.messages);
    ///         }
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn delete_checked(
        &self,
        conn: &lapin::Connection,
        held: HeldMessages,
    ) -> Result<Vec<QueueMessages>, TopologyError> {
        let mut session = Session::new(conn);
        let result = match held {
            HeldMessages::Discard => self.delete_discarding(&mut session).await,
            HeldMessages::Refuse => self.delete_unused(&mut session).await,
        };
        session.close().await;
        result
    }

    /// The delay queues that may hold messages: the levels, top down, then the parking queue.
    fn delay_queues(&self) -> Vec<String> {
        let mut v: Vec<String> = (0..self.configured_levels())
            .rev()
            .map(|k| self.level_name(k))
            .collect();
        v.push(self.unroutable_name());
        v
    }

    fn not_empty(
        &self,
        non_empty: Vec<QueueMessages>,
        already_deleted: Vec<String>,
    ) -> TopologyError {
        TopologyError::DelayNotEmpty {
            prefix: self.configured_prefix().to_owned(),
            non_empty,
            already_deleted,
        }
    }

    /// Deletes everything, in the order messages flow (a level's queue before its exchange,
    /// the parking queue last but for its exchange), counting what each queue held.
    async fn delete_discarding(
        &self,
        s: &mut Session<'_>,
    ) -> Result<Vec<QueueMessages>, TopologyError> {
        let mut discarded = Vec::new();
        let mut queue = |name: String, held: Option<u32>| {
            if let Some(messages) = held.filter(|n| *n > 0) {
                discarded.push(QueueMessages {
                    queue: name,
                    messages,
                });
            }
        };
        for k in (0..self.configured_levels()).rev() {
            let name = self.level_name(k);
            let held = s.delete_queue(&name).await?;
            queue(name.clone(), held);
            delete_exchange(s, name).await?;
        }
        delete_exchange(s, self.deliver_exchange()).await?;
        let parking = self.unroutable_name();
        let held = s.delete_queue(&parking).await?;
        queue(parking.clone(), held);
        delete_exchange(s, parking).await?;
        delete_exchange(s, self.settings_name()).await?;
        Ok(discarded)
    }

    /// [`HeldMessages::Refuse`]: see [`Self::delete_checked`].
    async fn delete_unused(
        &self,
        s: &mut Session<'_>,
    ) -> Result<Vec<QueueMessages>, TopologyError> {
        // Count everything first, so a refusal changes nothing.
        let mut held = Vec::new();
        for queue in self.delay_queues() {
            if let Some(messages) = s.count(&queue).await?.filter(|n| *n > 0) {
                held.push(QueueMessages { queue, messages });
            }
        }
        if !held.is_empty() {
            return Err(self.not_empty(held, Vec::new()));
        }
        // Every way in closed first, then one pause for what was routed before: a publish the
        // exchange routed just before the unbind still travels to the queue (to a quorum
        // queue's leader through the publisher's channel), and counted too early it would be
        // deleted with the queue. RabbitMQ then even confirms it (its queue is gone), so the
        // publisher believes the retry is stored.
        let levels: Vec<(String, String)> = (0..self.configured_levels())
            .rev()
            .map(|k| (self.level_name(k), self.level_binding_key(k, true)))
            .collect();
        for (name, key) in &levels {
            // A missing queue or exchange means there is no binding to remove.
            s.run_missing_ok(&Op::UnbindQueue {
                queue: name.clone(),
                exchange: name.clone(),
                key: key.clone(),
            })
            .await?;
        }
        tokio::time::sleep(IN_FLIGHT).await;
        // The level queues that exist, with what they hold now.
        let mut counted = Vec::new();
        for (name, key) in &levels {
            if let Some(n) = s.count(name).await? {
                counted.push((name, key, n));
            }
        }
        let arrived: Vec<QueueMessages> = counted
            .iter()
            .filter(|(_, _, n)| *n > 0)
            .map(|(name, _, n)| QueueMessages {
                queue: (*name).clone(),
                messages: *n,
            })
            .collect();
        if !arrived.is_empty() {
            // Put the ways in back: every queue stays as it was.
            for (name, key, _) in &counted {
                let bind = Op::BindQueue {
                    queue: (*name).clone(),
                    exchange: (*name).clone(),
                    key: (*key).clone(),
                };
                if let Err(e) = s.run(&bind).await {
                    return Err(TopologyError::DelayRestore {
                        queue: (*name).clone(),
                        source: Box::new(e),
                    });
                }
            }
            return Err(self.not_empty(arrived, Vec::new()));
        }
        let mut deleted = Vec::new();
        for (name, _, _) in counted {
            s.delete_queue(name).await?;
            deleted.push(name.clone());
        }
        // No level queue is left, so nothing is waiting to expire into these exchanges; a retry
        // published from now on fails at its publisher (404) instead of vanishing.
        for k in (0..self.configured_levels()).rev() {
            delete_exchange(s, self.level_name(k)).await?;
        }
        delete_exchange(s, self.deliver_exchange()).await?;
        let parking = self.unroutable_name();
        // Last, the exchange that leads to the parking queue: every exchange naming it as its
        // alternate is gone, so nothing can reach the queue when it is counted again.
        delete_exchange(s, parking.clone()).await?;
        delete_exchange(s, self.settings_name()).await?;
        tokio::time::sleep(IN_FLIGHT).await;
        match s.count(&parking).await? {
            Some(messages) if messages > 0 => Err(self.not_empty(
                vec![QueueMessages {
                    queue: parking,
                    messages,
                }],
                deleted,
            )),
            Some(_) => {
                s.delete_queue(&parking).await?;
                Ok(Vec::new())
            }
            None => Ok(Vec::new()),
        }
    }
}

/// Deletes an exchange; one that does not exist is skipped.
async fn delete_exchange(s: &mut Session<'_>, name: String) -> Result<(), TopologyError> {
    s.run_missing_ok(&Op::DeleteExchange { name }).await?;
    Ok(())
}

impl Topology {
    /// Deletes the delay infrastructure with [`DelayConfig::delete_checked`], then, unless it
    /// was refused, `Q`, `Q.dlq` and `Q.dlx` ([`Self::delete`]). The delay infrastructure goes
    /// first, so a refusal leaves this queue's objects in place too. Returns the delay queues
    /// deleted with their messages ([`HeldMessages::Discard`] only).
    ///
    /// The delay infrastructure is shared by every queue of its prefix: delete it with the last
    /// of them.
    ///
    /// ```no_run
    /// # async fn demo(conn: &redeliver_amqp::lapin::Connection) -> Result<(), redeliver_amqp::TopologyError> {
    /// use redeliver_amqp::{HeldMessages, Topology};
    ///
    /// let topo = Topology::new("images").prefix("staging.");
    /// let discarded = topo.delete_with_delay(conn, HeldMessages::Discard).await?;
    /// for q in discarded {
    ///     println!("deleted '{}' with {} message(s)", q.queue, q.messages);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn delete_with_delay(
        &self,
        conn: &lapin::Connection,
        held: HeldMessages,
    ) -> Result<Vec<QueueMessages>, TopologyError> {
        let discarded = self.configured_delay().delete_checked(conn, held).await?;
        self.delete(conn).await?;
        Ok(discarded)
    }
}
