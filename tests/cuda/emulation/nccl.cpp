// tests/cuda/emulation/nccl.cpp: NCCL for ONE rank on the CUDA emulation (test infrastructure, not
// part of the library), so that NcclCommunicator (graphmoe/backend/cuda/nccl.cuh) runs in CI without a
// GPU or libnccl: test_emu_cuda_nccl links this instead of libnccl.
//
// It implements the calls NcclCommunicator makes, for a communicator of one rank (nranks 1, rank
// 0; anything else is ncclInvalidArgument, as there is no second process to talk to):
//   ncclGetUniqueId, ncclCommInitRank, ncclCommDestroy, ncclCommAbort, ncclCommGetAsyncError,
//   ncclGetErrorString, ncclGetLastError, ncclAllReduce / ncclBroadcast (one rank: a copy),
//   ncclGroupStart / ncclGroupEnd, ncclSend / ncclRecv (to itself, matched in order at the end of
//   the outermost group, counts and types checked: a mismatch is ncclInvalidUsage).
// Buffers go through the emulation's cudaMemcpy (DeviceToDevice), so a pointer outside a live
// cudaMalloc allocation (host memory) is refused with ncclInvalidArgument, as real NCCL refuses
// host pointers. Calls on a destroyed or aborted communicator are not detected (real NCCL's
// behaviour is undefined there too); NcclCommunicator never makes them.
//
// What it cannot check: anything between two ranks (reductions, ordering, deadlocks, a dead
// peer), streams (everything completes at once), and the real library's argument checks.
#include <nccl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

struct ncclComm {
  struct Op {
    bool send;
    void* buffer;
    std::size_t bytes;
    ncclDataType_t type;
  };
  std::vector<Op> group;  // sends and receives of the open group
  std::string last_error;
};

namespace {

int group_depth = 0;
std::vector<ncclComm*> group_comms;
std::string global_last_error;

std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

ncclResult_t fail(ncclComm* comm, ncclResult_t rc, const std::string& what) {
  global_last_error = what;
  if (comm != nullptr) comm->last_error = what;
  return rc;
}

// dst := src (bytes), both inside live device allocations.
ncclResult_t device_copy(ncclComm* comm, void* dst, const void* src, std::size_t bytes,
                         const char* call) {
  if (bytes == 0) return ncclSuccess;
  if (cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice) != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(comm, ncclInvalidArgument,
                std::string(call) + ": a buffer is not device memory (emulated NCCL)");
  }
  return ncclSuccess;
}

ncclResult_t run_group(ncclComm* comm) {
  std::vector<ncclComm::Op> ops;
  ops.swap(comm->group);
  std::vector<const ncclComm::Op*> sends, recvs;
  for (const auto& op : ops) (op.send ? sends : recvs).push_back(&op);
  if (sends.size() != recvs.size()) {
    return fail(comm, ncclInvalidUsage,
                "ncclGroupEnd: " + std::to_string(sends.size()) + " sends to self but " +
                    std::to_string(recvs.size()) + " receives (emulated NCCL: would hang)");
  }
  for (std::size_t i = 0; i < sends.size(); ++i) {
    if (sends[i]->bytes != recvs[i]->bytes || sends[i]->type != recvs[i]->type) {
      return fail(comm, ncclInvalidUsage,
                  "ncclGroupEnd: send " + std::to_string(i) + " has " +
                      std::to_string(sends[i]->bytes) + " bytes, its receive " +
                      std::to_string(recvs[i]->bytes) + " (emulated NCCL)");
    }
    if (const ncclResult_t rc =
            device_copy(comm, recvs[i]->buffer, sends[i]->buffer, sends[i]->bytes, "ncclSend");
        rc != ncclSuccess) {
      return rc;
    }
  }
  return ncclSuccess;
}

ncclResult_t enqueue(ncclComm* comm, bool send, const void* buffer, std::size_t count,
                     ncclDataType_t type, int peer) {
  if (comm == nullptr) return fail(nullptr, ncclInvalidArgument, "null communicator");
  if (peer != 0) return fail(comm, ncclInvalidArgument, "peer out of range (one rank)");
  const std::size_t es = type_size(type);
  if (es == 0) return fail(comm, ncclInvalidArgument, "unsupported data type");
  if (group_depth == 0) {
    return fail(comm, ncclInvalidUsage,
                "ncclSend / ncclRecv to self outside a group (emulated NCCL: would hang)");
  }
  comm->group.push_back({send, const_cast<void*>(buffer), count * es, type});
  bool listed = false;
  for (ncclComm* c : group_comms) listed = listed || c == comm;
  if (!listed) group_comms.push_back(comm);
  return ncclSuccess;
}

}  // namespace

extern "C" {

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  return comm != nullptr ? comm->last_error.c_str() : global_last_error.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return fail(nullptr, ncclInvalidArgument, "ncclGetUniqueId: null id");
  std::memset(id, 0, sizeof *id);
  std::memcpy(id->internal, "graphmoe-emulated-nccl", 22);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  if (comm == nullptr) return fail(nullptr, ncclInvalidArgument, "ncclCommInitRank: null comm");
  if (nranks != 1 || rank != 0) {
    return fail(nullptr, ncclInvalidArgument,
                "ncclCommInitRank: the emulated NCCL has one rank (nranks 1, rank 0)");
  }
  if (std::memcmp(id.internal, "graphmoe-emulated-nccl", 22) != 0) {
    return fail(nullptr, ncclInvalidArgument, "ncclCommInitRank: not an id of ncclGetUniqueId");
  }
  *comm = new ncclComm{};
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  if (comm == nullptr || async_error == nullptr) {
    return fail(comm, ncclInvalidArgument, "ncclCommGetAsyncError: null argument");
  }
  *async_error = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t, int* count) {
  *count = 1;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t, int* rank) {
  *rank = 0;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t) {
  if (comm == nullptr) return fail(nullptr, ncclInvalidArgument, "null communicator");
  const std::size_t es = type_size(type);
  if (es == 0) return fail(comm, ncclInvalidArgument, "ncclAllReduce: unsupported data type");
  if (op != ncclSum && op != ncclProd && op != ncclMin && op != ncclMax && op != ncclAvg) {
    return fail(comm, ncclInvalidArgument, "ncclAllReduce: unknown reduction");
  }
  // one rank: every reduction of one value is the value (in place: a check of the buffer)
  return device_copy(comm, recv, send, count * es, "ncclAllReduce");
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t) {
  if (comm == nullptr) return fail(nullptr, ncclInvalidArgument, "null communicator");
  if (root != 0) return fail(comm, ncclInvalidArgument, "ncclBroadcast: root out of range");
  const std::size_t es = type_size(type);
  if (es == 0) return fail(comm, ncclInvalidArgument, "ncclBroadcast: unsupported data type");
  return device_copy(comm, recv, send, count * es, "ncclBroadcast");
}

ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t type, int peer,
                      ncclComm_t comm, cudaStream_t) {
  return enqueue(comm, true, send, count, type, peer);
}

ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t) {
  return enqueue(comm, false, recv, count, type, peer);
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return fail(nullptr, ncclInvalidUsage, "ncclGroupEnd without a start");
  if (--group_depth > 0) return ncclSuccess;
  std::vector<ncclComm*> comms;
  comms.swap(group_comms);
  ncclResult_t result = ncclSuccess;
  for (ncclComm* c : comms) {
    const ncclResult_t rc = run_group(c);
    if (result == ncclSuccess) result = rc;
  }
  return result;
}

}  // extern "C"
