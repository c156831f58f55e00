// graphmoe/routing/aux_losses.hpp: the router's auxiliary losses, load_balance_loss and z_loss
// (the ops and their formulas: ops/aux_losses.hpp; every backend).
//
// How the router uses them (routing/router.hpp): with a token graph on, the load-balancing loss
// reads p, the distribution the selector actually ranks (after the graph), so the loss balances
// the decisions the router makes; with the Independent graph p = r and this is the usual Switch
// loss. The z-loss reads the scorer's logits gamma (before the graph).
#pragma once

#include "graphmoe/ops/aux_losses.hpp"
