// Status and StatusOr<T>: the error currency at module and RPC boundaries.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace ltrain {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kAlreadyExists,
  kFailedPrecondition,
  kUnavailable,
  kDeadlineExceeded,
  kInternal,
  kDataLoss,
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }

const char* StatusCodeName(StatusCode code);

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  StatusOr(Status status) : status_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace ltrain

// Returns the Status of `expr` from the calling function (which returns Status or StatusOr) when it
// is an error.
#define LTRAIN_RETURN_IF_ERROR(expr)                                  \
  do {                                                                \
    if (::ltrain::Status ltrain_status_ = (expr); !ltrain_status_.ok()) { \
      return ltrain_status_;                                          \
    }                                                                 \
  } while (false)

// `lhs` (a declaration such as `auto x` or an existing variable) takes the value of the StatusOr
// `expr`; its error is returned from the calling function instead.
#define LTRAIN_ASSIGN_OR_RETURN(lhs, expr) \
  LTRAIN_ASSIGN_OR_RETURN_IMPL(LTRAIN_STATUS_CONCAT(ltrain_status_or_, __LINE__), lhs, expr)
#define LTRAIN_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                                 \
  if (!statusor.ok()) return statusor.status();           \
  lhs = std::move(statusor).value()
#define LTRAIN_STATUS_CONCAT_INNER(a, b) a##b
#define LTRAIN_STATUS_CONCAT(a, b) LTRAIN_STATUS_CONCAT_INNER(a, b)
