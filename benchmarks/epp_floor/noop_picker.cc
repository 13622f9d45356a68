// A no-op ext_proc endpoint picker in C++ (grpc++ callback API, generic service: raw bytes, no
// protobuf library): what the endpoint-picker protocol costs through Envoy when the picker itself
// costs next to nothing (benchmarks/epp_floor.py). It answers a request's headers with CONTINUE and
// its BUFFERED body with one fixed pick, both answers given as serialized ProcessingResponses by the
// benchmark (the real protobuf types, router/epp/protocol.py); Envoy's access-log stream is read
// and dropped. A message's kind is its first field's number: Envoy serializes ProcessingRequest in
// field order, the request's oneof (request_headers = 2, request_body = 4) before the metadata.
//
//   g++ -O2 -o noop_picker noop_picker.cc $(pkg-config --cflags --libs grpc++)
//   noop_picker 127.0.0.1:PORT HEADERS_ANSWER_FILE BODY_ANSWER_FILE
#include <grpcpp/grpcpp.h>
#include <grpcpp/generic/async_generic_service.h>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

static std::string headers_answer, body_answer;

static std::string read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s; s << in.rdbuf(); return s.str();
}

class ExtProcReactor : public grpc::ServerGenericBidiReactor {
 public:
  explicit ExtProcReactor(bool ext_proc) : ext_proc_(ext_proc) { StartRead(&in_); }
  void OnReadDone(bool ok) override {
    if (!ok) {  // the peer half-closed, or the call ended
      Finish(grpc::Status::OK);
      return;
    }
    if (!ext_proc_) { in_.Clear(); StartRead(&in_); return; }  // access log: read and drop
    std::vector<grpc::Slice> slices;
    in_.Dump(&slices);
    unsigned char first = slices.empty() || slices[0].size() == 0 ? 0 : slices[0].begin()[0];
    int field = first >> 3;
    const std::string* answer = nullptr;
    if (field == 2) answer = &headers_answer;
    else if (field == 4) answer = &body_answer;
    if (answer == nullptr) { in_.Clear(); StartRead(&in_); return; }
    grpc::Slice out_slice(answer->data(), answer->size());
    out_ = grpc::ByteBuffer(&out_slice, 1);
    StartWrite(&out_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) { Finish(grpc::Status::OK); return; }
    in_.Clear();
    StartRead(&in_);
  }
  void OnDone() override { delete this; }
 private:
  bool ext_proc_;
  grpc::ByteBuffer in_, out_;
};

class Service : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    const std::string& method = ctx->method();
    return new ExtProcReactor(method.find("ExternalProcessor") != std::string::npos);
  }
};

int main(int argc, char** argv) {
  if (argc != 4) { std::cerr << "usage: noop_picker ADDRESS HEADERS_ANSWER BODY_ANSWER\n"; return 2; }
  headers_answer = read_file(argv[2]);
  body_answer = read_file(argv[3]);
  Service service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(argv[1], grpc::InsecureServerCredentials());
  builder.RegisterCallbackGenericService(&service);
  auto server = builder.BuildAndStart();
  std::cout << "listening" << std::endl;
  server->Wait();
}
