//! What the open streams will read. A stream reads one epoch's order of its dataset, a pure
//! function of (dataset size, seed, epoch, shuffle), from a position on; the epoch after it
//! (same seed, epoch + 1) is known as well. An `Order` answers, for a sample, where it comes in
//! that order (the inverse permutation), which is all a next-use policy needs: the stream's
//! position and speed give the time. Every stream on one order (a job's ranks and workers,
//! jobs of a grid search on one seed) shares one `Order`, made once (`Orders`).

use crate::sampler::{epoch_order, node_order, Correlated, EpochOrder, NodeSplit, OrderForm};
use crate::sync::Locked;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

/// Which order: of which dataset, over how many samples, from which seed and epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OrderKey {
    pub dataset: u32,
    pub num_samples: u64,
    pub seed: u64,
    pub epoch: u64,
    pub shuffle: bool,
    /// A node's part of the epoch (`sampler::NodeSplit`): its order is that part's.
    pub split: Option<NodeSplit>,
    pub form: OrderForm,
    /// A cohort's correlated order (form 2 only).
    pub correlated: Option<Correlated>,
}

impl OrderKey {
    /// The order of the epoch after this one (from its start, on the same nodes).
    pub fn next(&self) -> OrderKey {
        OrderKey {
            epoch: self.epoch.wrapping_add(1),
            split: self.split.map(|s| NodeSplit { resumed: None, ..s }),
            ..*self
        }
    }
}

/// One epoch's order, seen from the sample.
#[derive(Debug)]
pub struct Order {
    pub key: OrderKey,
    position: Where,
}

/// Where a sample comes in an order.
#[derive(Debug)]
enum Where {
    /// Not shuffled: sample s comes at s.
    Identity,
    /// `[s]`: where sample s comes (u32::MAX: in another node's part).
    Listed(Box<[u32]>),
    /// The inverse of the epoch's computed order.
    Computed(EpochOrder),
}

impl Order {
    /// The order `key` names; None when it is listed and too long to keep (more than 2^32 - 1
    /// samples, shuffled): a stream on it publishes no future.
    pub fn new(key: OrderKey) -> Option<Order> {
        if key.form.computed(key.split.as_ref(), key.shuffle) {
            return Some(Order {
                key,
                position: Where::Computed(EpochOrder::new(
                    key.num_samples,
                    key.seed,
                    key.epoch,
                    key.correlated,
                )),
            });
        }
        if let Some(split) = &key.split {
            if key.num_samples >= u32::MAX as u64 {
                return None;
            }
            // Samples of other nodes' parts never come (u32::MAX: no position).
            let (order, _) = node_order(key.num_samples, key.seed, key.epoch, key.shuffle, split);
            let mut position = vec![u32::MAX; key.num_samples as usize].into_boxed_slice();
            for (p, &s) in order.iter().enumerate() {
                position[s as usize] = p as u32;
            }
            return Some(Order {
                key,
                position: Where::Listed(position),
            });
        }
        if !key.shuffle {
            return Some(Order {
                key,
                position: Where::Identity,
            });
        }
        if key.num_samples >= u32::MAX as u64 {
            return None;
        }
        let order = epoch_order(key.num_samples, key.seed, key.epoch, true);
        let mut position = vec![0u32; order.len()].into_boxed_slice();
        for (p, &s) in order.iter().enumerate() {
            position[s as usize] = p as u32;
        }
        Some(Order {
            key,
            position: Where::Listed(position),
        })
    }

    /// Samples in the order.
    pub fn len(&self) -> u64 {
        self.key.num_samples
    }

    pub fn is_empty(&self) -> bool {
        self.key.num_samples == 0
    }

    /// Where `sample` comes in the order (None if the dataset has no such sample, or it is in
    /// another node's part).
    #[inline]
    pub fn position(&self, sample: u64) -> Option<u64> {
        if sample >= self.key.num_samples {
            return None;
        }
        match &self.position {
            // Another node's sample: this stream never reads it.
            Where::Listed(p) if p[sample as usize] == u32::MAX => None,
            Where::Listed(p) => Some(p[sample as usize] as u64),
            Where::Identity => Some(sample),
            Where::Computed(perm) => Some(perm.position(sample)),
        }
    }

    /// Bytes it takes.
    pub fn bytes(&self) -> usize {
        std::mem::size_of::<Order>()
            + match &self.position {
                Where::Listed(p) => p.len() * 4,
                _ => 0,
            }
    }
}

/// The orders streams read, each made once while any stream holds it.
#[derive(Default)]
pub struct Orders {
    made: Mutex<HashMap<OrderKey, Weak<Order>>>,
}

impl Orders {
    /// The order `key` names, shared with every stream already on it. Made outside the lock
    /// (an order of a million samples takes some milliseconds).
    pub fn get(&self, key: OrderKey) -> Option<Arc<Order>> {
        if let Some(order) = self.lock().get(&key).and_then(Weak::upgrade) {
            return Some(order);
        }
        let order = Arc::new(Order::new(key)?);
        let mut made = self.lock();
        // Another stream may have made it meanwhile: keep one.
        if let Some(other) = made.get(&key).and_then(Weak::upgrade) {
            return Some(other);
        }
        made.retain(|_, o| o.strong_count() > 0);
        made.insert(key, Arc::downgrade(&order));
        Some(order)
    }

    /// Orders some stream still holds.
    pub fn live(&self) -> usize {
        self.lock()
            .values()
            .filter(|o| o.strong_count() > 0)
            .count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<OrderKey, Weak<Order>>> {
        self.made.locked()
    }
}

/// What happened to a stream, as the memory tier's policy hears it.
#[derive(Debug, Clone)]
pub enum StreamEvent {
    /// Stream `id` opened: it reads `order` from `position` on, then (if its job goes on)
    /// `next`.
    Opened {
        id: u64,
        order: Arc<Order>,
        next: Arc<Order>,
        position: u64,
    },
    /// Stream `id` is reading its order up to `position` (every sample before it, in its share,
    /// is read or being read).
    At { id: u64, position: u64 },
    /// Stream `id` ended: having read its whole epoch (`finished`: its job usually opens the
    /// next epoch at once), or cut short (its client went away: its future is gone).
    Closed { id: u64, finished: bool },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seed: u64, epoch: u64, shuffle: bool) -> OrderKey {
        OrderKey {
            dataset: 1,
            num_samples: 1000,
            seed,
            epoch,
            shuffle,
            split: None,
            form: OrderForm::V1,
            correlated: None,
        }
    }

    #[test]
    fn an_order_is_the_inverse_of_the_epochs_permutation() {
        let order = Order::new(key(7, 3, true)).unwrap();
        for (p, s) in epoch_order(1000, 7, 3, true).into_iter().enumerate() {
            assert_eq!(order.position(s), Some(p as u64));
        }
        assert_eq!(order.position(1000), None);
        let plain = Order::new(key(7, 3, false)).unwrap();
        assert_eq!(plain.position(17), Some(17));
        assert_eq!(key(7, 3, true).next(), key(7, 4, true));
    }

    /// A computed order's positions are where a V2 plan of the whole epoch serves each sample.
    #[test]
    fn a_computed_order_is_where_a_v2_plan_serves_each_sample() {
        use crate::sampler::{Plan, PlanRequest};
        let key = OrderKey {
            form: OrderForm::V2,
            ..key(7, 3, true)
        };
        let order = Order::new(key).unwrap();
        assert!(order.bytes() < 256);
        let plan = Plan::new(PlanRequest {
            order: OrderForm::V2,
            ..PlanRequest::epoch(1000, 10, 7, 3)
        })
        .unwrap();
        for b in 0..plan.num_batches {
            for (i, &s) in plan.batch(b).iter().enumerate() {
                assert_eq!(order.position(s), Some(b * 10 + i as u64));
            }
        }
    }

    #[test]
    fn streams_on_one_order_share_it_and_it_goes_with_the_last() {
        let orders = Orders::default();
        let a = orders.get(key(1, 0, true)).unwrap();
        let b = orders.get(key(1, 0, true)).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let c = orders.get(key(2, 0, true)).unwrap();
        assert_eq!(orders.live(), 2);
        drop((a, b));
        assert_eq!(orders.live(), 1);
        drop(c);
        assert_eq!(orders.live(), 0);
    }
}
