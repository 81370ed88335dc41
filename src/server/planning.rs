//! What opening a stream costs the daemon, charged to whoever opens it before it is built
//! (see `footprint`). A computed order (`OrderForm::V2`, no node split) costs a few bytes a
//! stream. A listed one costs building its plan (the epoch's whole order, for the while it is
//! built), the plan (its shard's samples) and, for a shuffled epoch, the epoch's order the
//! memory tier keeps (where each sample comes: four bytes a sample, one for all the streams a
//! user has on that order). Plans are built off the async threads, a few at a time per user
//! (`limits.plans_per_user`): a user asking for many waits for their own.

use crate::access::Caller;
use crate::footprint::{Charge, Footprint, Payer};
use crate::sampler::{NodeSplit, OrderForm, Plan, PlanRequest};
use crate::sync::Locked;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use tonic::Status;

/// A user's orders, as charged: one charge per (payer, dataset, seed, epoch, split), held by
/// every stream of theirs on it.
type OrderKey = (Payer, u32, u64, u64, Option<NodeSplit>, OrderForm);

pub struct Planning {
    account: Arc<Footprint>,
    turns: crate::turns::Turns,
    orders: Mutex<HashMap<OrderKey, Weak<Charge>>>,
}

/// What a stream holds of the account while it lasts.
pub struct Costs {
    _plan: Charge,
    _order: Option<Arc<Charge>>,
}

impl Planning {
    pub fn new(account: Arc<Footprint>, plans_per_user: u32) -> Planning {
        Planning {
            account,
            turns: crate::turns::Turns::new(plans_per_user as usize),
            orders: Mutex::default(),
        }
    }

    /// The payer of what `who` asks for.
    pub fn payer(who: &Caller) -> Payer {
        match who {
            Caller::Local(id) => Payer::of_uid(Some(id.uid)),
            Caller::Tcp => Payer::Tcp,
        }
    }

    /// Builds the plan `req` asks of dataset `name` (id `dataset`) for `who`, charged to them
    /// first (with the epoch's order when `with_order` and the epoch is shuffled), on a
    /// blocking thread in their turn. RESOURCE_EXHAUSTED, saying what it would cost, when the
    /// charge does not fit.
    pub async fn build(
        &self,
        who: &Caller,
        (dataset, name): (u32, &str),
        req: PlanRequest,
        with_order: bool,
    ) -> Result<(Plan, Costs), Status> {
        let payer = Planning::payer(who);
        let what = format!(
            "a stream of dataset {name:?} (batch_size {}, rank {} of {})",
            req.batch_size,
            req.rank,
            req.world_size.max(1)
        );
        let plan_charge =
            self.account
                .charge(payer, Plan::bytes_for(&req), &format!("{what}: its plan"))?;
        let order = match with_order && req.shuffle && Plan::listed(&req) {
            true => Some(self.order(payer, dataset, &req, &what)?),
            false => None,
        };
        let _turn = self.turns.take(payer_key(payer)).await;
        // Building a listed order lists the whole epoch: charged while it is built.
        let building = Plan::building_bytes(&req);
        let _building =
            self.account
                .charge(payer, building, &format!("{what}: building its plan"))?;
        let plan = tokio::task::spawn_blocking(move || Plan::new(req))
            .await
            .map_err(|e| Status::internal(format!("building the plan failed: {e}")))?
            .map_err(|e| {
                crate::error::Error::new(crate::error::Kind::BadRequest, format!("{e:#}"))
            })?;
        Ok((
            plan,
            Costs {
                _plan: plan_charge,
                _order: order,
            },
        ))
    }

    /// The charge for the order `req` reads, shared by the payer's streams on it.
    fn order(
        &self,
        payer: Payer,
        dataset: u32,
        req: &PlanRequest,
        what: &str,
    ) -> Result<Arc<Charge>, Status> {
        let form = req.order.effective(req.split.as_ref(), req.shuffle);
        let key = (payer, dataset, req.seed, req.epoch, req.split, form);
        let mut orders = self.orders.locked();
        if let Some(c) = orders.get(&key).and_then(Weak::upgrade) {
            return Ok(c);
        }
        orders.retain(|_, w| w.strong_count() > 0);
        let bytes = req.num_samples.saturating_mul(4);
        let c = Arc::new(self.account.charge(
            payer,
            bytes,
            &format!("{what}: the epoch's order of {} samples", req.num_samples),
        )?);
        orders.insert(key, Arc::downgrade(&c));
        Ok(c)
    }
}

/// A payer as a key of `Turns`.
fn payer_key(payer: Payer) -> u64 {
    match payer {
        Payer::User(uid) => uid as u64,
        Payer::Config => u64::MAX,
        Payer::Tcp => u64::MAX - 1,
    }
}
