// graphmoe/layers/loss.hpp: a model's training objective, broken down.
//
// The models' forward returns a Loss; their backward computes the gradient of loss.total(): the
// task loss and the routers' auxiliary losses, each auxiliary term already multiplied by its
// coefficient (RouterConfig::load_balance_coef, z_loss_coef, seq_aux_loss_coef; 0 = off, the
// default). The
// auxiliary gradients enter in each router's backward (routing/router.hpp), so what forward
// reports here is exactly what backward differentiates.
#pragma once

namespace graphmoe {

struct Loss {
  double task = 0;          // mean cross-entropy (0 when forward had no targets / labels)
  double load_balance = 0;  // sum over MoE layers of load_balance_coef * Switch load-balancing loss
  double z_loss = 0;        // sum over MoE layers of z_loss_coef * ST-MoE router z-loss
  double seq_aux = 0;       // sum over MoE layers of seq_aux_loss_coef * sequence-wise balance loss

  double aux() const { return load_balance + z_loss + seq_aux; }
  double total() const { return task + aux(); }  // the objective backward differentiates

  Loss& operator+=(const Loss& o) {
    task += o.task;
    load_balance += o.load_balance;
    z_loss += o.z_loss;
    seq_aux += o.seq_aux;
    return *this;
  }
};

}  // namespace graphmoe
